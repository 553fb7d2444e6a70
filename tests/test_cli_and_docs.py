"""The CLI's help and JSON output, and every Python example in the README, executed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from decoding.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent


def specrag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, cwd=ROOT, check=False, timeout=600
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


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)


def test_the_readme_has_python_examples() -> None:
    assert readme_python_blocks()


@pytest.fixture(scope="module")
def readme_server(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The README's HTTP examples talk to a real server (smollm2 for speed) at $SPECRAG_BASE_URL."""
    from agent.server import create_app
    from tests.server_helpers import LiveServer, sample_agent

    agent = sample_agent(smollm2, tmp_path_factory.getbasetemp())
    with LiveServer(create_app(agent, api_key="")) as url:
        yield url
    agent.close()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_example_runs(
    index: int, smollm2: CausalLM, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = readme_python_blocks()[index]
    if "SPECRAG_BASE_URL" in block:
        monkeypatch.setenv("SPECRAG_BASE_URL", request.getfixturevalue("readme_server"))
        monkeypatch.delenv("SPECRAG_API_KEY", raising=False)
    exec(compile(block, f"README.md example {index}", "exec"), {})
