"""Crash safety: a real build process SIGKILLed at many moments never damages the live index.

The killed build rewrites the sample index with 400 copies of every topic under new names (about
15,000 chunks, 60 MB). Every copy's vectors are reused by SHA-256, so the child never loads the
model and spends its second or so loading, assembling, writing and fsyncing: the window to hit.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specrag.retrieval import Retriever, load_index
from tests.retrieval_helpers import sample_index, shared_embedder

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COPIES = 400
QUERIES = ("with statement context manager", "lambda expression", "raise an exception", "global names")
BUILD = """
import sys
from specrag.retrieval import Corpus, Document, Embedder, build_index
from tests.retrieval_helpers import chunker, sample_subset

out, copies = sys.argv[1], int(sys.argv[2])
base = sample_subset().documents
copied = [Document(f"copy{i:04d}/{d.source}", d.text, d.sha256) for i in range(copies) for d in base]
report = build_index(out, Corpus([*base, *copied]), Embedder(), chunker())
print(report.chunks_embedded, report.chunks_total)
"""


def answers(root: Path, version: str | None = None) -> list[list[tuple[str, float]]]:
    retriever = Retriever(load_index(root, version=version), shared_embedder())
    return [[(hit.id, hit.score) for hit in retriever.search(query, k=5)] for query in QUERIES]


def start_build(root: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", BUILD, str(root), str(COPIES)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def staged(root: Path, name: str | None = None) -> bool:
    """A version is being written in tmp/ (and, if ``name``, that file of it exists)."""
    tmp = root / "tmp"
    entries = list(tmp.iterdir()) if tmp.is_dir() else []
    return any(name is None or (entry / name).exists() for entry in entries)


def kill_when(process: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float = 60.0) -> bool:
    """SIGKILL the build as soon as ``ready()``; False if it finished first."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        if ready():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.001)
    process.wait()
    return False


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[tuple[str, float]]], int]:
    root, report = sample_index(tmp_path_factory.getbasetemp())
    return root, answers(root), report.chunks_total * (COPIES + 1)


def fresh_copy(base_root: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(base_root, tmp_path / name))


def assert_intact(root: Path, baseline: list[list[tuple[str, float]]], full_count: int) -> str:
    """The live version is the old one answering as before, or the complete new one; the old one survives."""
    live = load_index(root)
    if live.version == "00000001":
        assert answers(root) == baseline
    else:
        assert live.version == "00000002" and len(live.chunks) == full_count
    assert answers(root, version="00000001") == baseline
    return live.version


def test_an_uninterrupted_build_then_kills_at_each_stage(
    base: tuple[Path, list[list[tuple[str, float]]], int], tmp_path: Path
) -> None:
    base_root, baseline, full_count = base
    complete = fresh_copy(base_root, tmp_path, "complete")
    started = time.monotonic()
    process = start_build(complete)
    out, err = process.communicate(timeout=120)
    duration = time.monotonic() - started
    assert process.returncode == 0, err.decode()
    assert out.split() == [b"0", str(full_count).encode()]  # nothing re-embedded: all reused by SHA
    assert assert_intact(complete, baseline, full_count) == "00000002"

    stages: dict[str, Callable[[Path], Callable[[], bool]]] = {
        "temp dir created": lambda root: lambda: staged(root),
        "faiss file being written": lambda root: lambda: staged(root, "index.faiss"),
        "embeddings being written": lambda root: lambda: staged(root, "embeddings.npy"),
        "manifest written": lambda root: lambda: staged(root, "manifest.json"),
        "version renamed into place": lambda root: (root / "versions" / "00000002").exists,
    }
    outcomes = {}
    for n, (stage, condition) in enumerate(stages.items()):
        root = fresh_copy(base_root, tmp_path, f"stage{n}")
        killed = kill_when(start_build(root), condition(root))
        outcomes[stage] = (killed, assert_intact(root, baseline, full_count))
    # Killed while still writing, the old version must be the live one.
    assert outcomes["temp dir created"] == (True, "00000001")
    assert outcomes["faiss file being written"] == (True, "00000001")

    rng = random.Random(20)
    for n in range(4):
        root = fresh_copy(base_root, tmp_path, f"random{n}")
        process = start_build(root)
        time.sleep(rng.uniform(0.2, duration))
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert_intact(root, baseline, full_count)


def test_the_next_build_after_a_kill_cleans_up_and_succeeds(
    base: tuple[Path, list[list[tuple[str, float]]], int], tmp_path: Path
) -> None:
    base_root, baseline, full_count = base
    root = fresh_copy(base_root, tmp_path, "recover")
    assert kill_when(start_build(root), lambda: staged(root, "embeddings.npy"))
    assert staged(root), "the killed build left its temp dir behind"
    process = start_build(root)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err.decode()
    assert not staged(root)
    assert len(load_index(root).chunks) == full_count
    assert sorted(path.name for path in (root / "versions").iterdir()) == ["00000001", "00000002"]
    assert answers(root, version="00000001") == baseline


def test_two_concurrent_builds_into_one_directory_take_turns(
    base: tuple[Path, list[list[tuple[str, float]]], int], tmp_path: Path
) -> None:
    base_root, baseline, full_count = base
    root = fresh_copy(base_root, tmp_path, "concurrent")
    first, second = start_build(root), start_build(root)
    results = [process.communicate(timeout=120) for process in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], [err.decode() for _, err in results]
    # Without the lock both would stage generation 2 and one rename would fail; with it the
    # second build waits, finds the first one's version up to date and writes nothing.
    assert sorted(path.name for path in (root / "versions").iterdir()) == ["00000001", "00000002"]
    assert len(load_index(root).chunks) == full_count
    assert answers(root, version="00000001") == baseline
