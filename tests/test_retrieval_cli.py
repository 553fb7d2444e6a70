"""``specrag index build`` and ``specrag index search``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specrag.agent.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["index"], ["index", "build"], ["index", "search"]])
def test_index_commands_have_help(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specrag.agent.cli", *command, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0 and "usage: specrag index" in result.stdout


def make_docs(root: Path) -> Path:
    (root / "guide").mkdir(parents=True)
    (root / "guide" / "frogs.md").write_text("# Frogs\n\nFrogs are amphibians that croak near ponds at night.\n")
    (root / "taxes.html").write_text("<html><body><h1>Taxes</h1><p>File your quarterly taxes.</p></body></html>")
    (root / "empty.txt").write_text("")
    return root


@pytest.mark.slow
def test_build_update_and_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs, out = make_docs(tmp_path / "docs"), tmp_path / "index"
    build = ["index", "build", str(docs), "--out", str(out), "--tokenizer", "whitespace", "--max-tokens", "64"]
    assert main([*build, "--overlap", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] and report["added"] == ["guide/frogs.md", "taxes.html"]
    assert report["skipped_by_reason"] == {"empty": 1} and report["chunks_embedded"] == 2

    (docs / "guide" / "toads.md").write_text("Toads are warty frogs.")
    assert main([*build, "--overlap", "8"]) == 0
    text = capsys.readouterr().out
    assert "wrote version 00000002" in text and "added 1, changed 0, removed 0, unchanged 2" in text
    assert "1 embedded, 2 reused" in text

    assert main(["index", "search", str(out), "amphibians croaking", "-k", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passages"][0]["source"] == "guide/frogs.md" and len(result["passages"]) == 2
    assert set(result["timings"]) == {"embed_s", "search_s", "lexical_s"}

    assert main(["index", "search", str(out), "quarterly taxes", "-k", "1", "--dense"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("1. taxes.html#0") and "faiss" in captured.err


def test_docs_or_sample_but_not_both_and_not_neither(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["index", "build", "--out", str(tmp_path / "i")]) == 2
    assert main(["index", "build", str(tmp_path), "--sample", "--out", str(tmp_path / "i")]) == 2
    assert "not both" in capsys.readouterr().err


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "i")
    assert main(["index", "build", str(tmp_path / "missing"), "--out", out, "--tokenizer", "whitespace"]) == 1
    assert "not a folder" in capsys.readouterr().err
    assert main(["index", "build", str(tmp_path), "--out", out, "--overlap", "300", "--tokenizer", "whitespace"]) == 1
    assert "overlap" in capsys.readouterr().err
    assert main(["index", "build", str(tmp_path), "--out", out, "--tokenizer", "nonsense"]) == 1
    assert "unknown tokenizer" in capsys.readouterr().err
    assert main(["index", "search", str(tmp_path / "nothing"), "query"]) == 1
    assert "does not exist" in capsys.readouterr().err
