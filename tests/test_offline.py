"""Offline is set in one place (``decoding/__init__.py``) and holds whichever package loads first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "decoding", "retrieval", "tools", "evals")


@pytest.mark.parametrize("first", ["specrag.retrieval", "specrag.agent.cli", "specrag.tools", "specrag.agent.runtime"])
def test_every_entry_point_is_offline_before_the_hub_library_loads(first: str) -> None:
    environment = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    probe = f"import {first}\nimport huggingface_hub.constants as hub\nprint(hub.HF_HUB_OFFLINE)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_offline_mode_is_set_in_one_place() -> None:
    setters = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if re.search(r"environ(\.setdefault\(|\[)\s*[\"']HF_HUB_OFFLINE", path.read_text())
    ]
    assert setters == ["decoding/__init__.py"]
