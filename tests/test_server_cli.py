"""``specrag serve`` and ``specrag ask``: the entry points over the real smollm2 pack, and the
sample index built once and reused."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from specrag import retrieval
from specrag.agent import cli
from specrag.agent import sample_index as index_cache
from specrag.retrieval import Corpus
from tests.retrieval_helpers import sample_index, sample_subset, shared_embedder
from tests.server_helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model", "smollm2-135m", "--dtype", "float32"]
QUICK = ["--max-steps", "1", "--speculation", "on"]  # "auto" would calibrate the cost model first (seconds)


def specrag(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "specrag.agent.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False, timeout=600)


@contextmanager
def serving(*args: str) -> Iterator[str]:
    """``specrag serve *args`` on a free local port, once /healthz answers; yields its base URL.

    The server is always terminated. Its stderr goes to a file rather than a pipe nobody reads
    while it runs (a full pipe would stall the server's logging); a failure in the block or in
    the start carries that log's tail as a note, so a crash shows why.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "specrag.agent.cli", "serve", *args, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return server.poll() is not None  # stop waiting if it died

        def stop() -> None:
            server.terminate()
            server.wait(timeout=30)

        try:
            started = wait_until(healthy, timeout=300, interval=0.5) and server.poll() is None
            assert started, f"specrag serve did not become healthy (exit code {server.poll()})"
            yield url
        except BaseException as error:  # pytest's failures are BaseExceptions too
            stop()  # first, so the log is complete and nothing writes to it while it is read
            log.seek(0)
            error.add_note("specrag serve's stderr (tail):\n" + log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            stop()


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(sample_index(tmp_path_factory.getbasetemp())[0])


@pytest.mark.parametrize("command", ["serve", "ask"])
def test_help(command: str) -> None:
    result = specrag(command, "--help")
    assert result.returncode == 0 and f"usage: specrag {command}" in result.stdout


def test_ask_prints_the_answer_citations_and_a_stage_table(index_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    question = "What does the pass statement do?"
    assert cli.main(["ask", question, *MODEL, *QUICK, "--index", index_dir, "--max-tokens", "4", "-k", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip()  # the answer
    table = lines[lines.index(next(line for line in lines if line.startswith("stage"))) :]
    assert any(line.startswith("retrieval") for line in table) and any(line.startswith("chat") for line in table)
    assert any(line.startswith("total") for line in table)
    assert "tokens per target call" in lines[-1]


def test_ask_json_carries_the_result_and_its_trace(index_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["ask", "What does del do?", *MODEL, *QUICK, "--index", index_dir, "--max-tokens", "4", "-k", "1", "--json"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"answer", "citations", "usage", "speculation", "trace_id", "trace"} <= set(result)
    assert result["trace"]["trace_id"] == result["trace_id"]


def test_serve_runs_the_api_under_uvicorn(index_dir: str) -> None:
    with serving(*MODEL, "--index", index_dir) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "smollm2-135m"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120).status_code == 200


def test_the_sample_index_is_built_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", "/somewhere/else")
    assert index_cache.sample_index_dir() == Path("/somewhere/else/index/sample")
    # Not the cache itself: moving $SPECRAG_CACHE would re-pull the model packs too.
    monkeypatch.setattr(index_cache, "sample_index_dir", lambda: tmp_path / "index" / "sample")
    few = Corpus(sample_subset().documents[:3])  # the whole corpus takes a minute to embed
    monkeypatch.setattr(retrieval, "load_sample_corpus", lambda: few)
    monkeypatch.setattr(retrieval, "Embedder", shared_embedder)  # the session's, loaded once
    out = index_cache.ensure_sample_index("smollm2-135m")
    assert out == tmp_path / "index" / "sample" and out.is_dir()
    assert "wrote version" in capsys.readouterr().err
    assert index_cache.ensure_sample_index("smollm2-135m") == out
    assert "up to date" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_serves_the_users_tool_from_a_file() -> None:
    """The quick start's path: a tool in a file, ``specrag serve --tools``, a run that calls it."""
    tools = ["--tools", "examples/custom_tool.py:convert_temperature"]
    model = ["--model", "qwen2.5-coder-0.5b", "--dtype", "float32"]  # smollm2 does not call tools
    with serving(*model, *tools, "--no-index") as url:
        question = {"question": "What is 21 degrees Celsius in Fahrenheit?", "max_tokens": 64, "max_steps": 3}
        run = httpx.post(f"{url}/v1/agent/runs", json=question, timeout=600).json()
        calls = [step["tool_call"] for step in run["steps"] if step["kind"] == "tool_call"]
        assert calls[0] == {"name": "convert_temperature", "arguments": {"value": 21, "unit": "celsius"}}, run
        assert "69.8" in run["answer"], run["answer"]
        trace = httpx.get(f"{url}/v1/traces/{run['trace_id']}").json()
        assert "execute_tool convert_temperature" in [span["name"] for span in trace["spans"]]
