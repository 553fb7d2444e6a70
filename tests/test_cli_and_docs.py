"""The CLI's help and JSON output. The README's and docs/' examples are run by tests/test_docs.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specrag.decoding.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent


def specrag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specrag.agent.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=600,
    )


@pytest.mark.parametrize("command", [[], ["pull"], ["bench"], ["demo"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = specrag(*command, "--help")
    assert result.returncode == 0 and "usage: specrag" in result.stdout


def test_pull_json_reports_the_cached_pack(smollm2: CausalLM) -> None:
    result = specrag("pull", "smollm2-135m", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) | {"path": None} == {"pack": "smollm2-135m", "path": None, "converted": False}


def test_pull_rejects_an_unknown_pack() -> None:
    result = specrag("pull", "gpt-17")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.slow
def test_demo_json_is_identical_to_plain(smollm2: CausalLM) -> None:
    result = specrag("demo", "--json", "--compare", "--max-tokens", "24", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical_to_plain"] is True
    assert report["speculative"]["output_tokens"] == 24
