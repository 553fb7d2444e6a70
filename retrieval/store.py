"""The index on disk: versioned directories, atomic publication, locking and validated loading.

Owns this layout::

    DIR/CURRENT                       names the live version (replaced with os.replace)
    DIR/LOCK                          fcntl.flock'ed by a build, so two builds never interleave
    DIR/tmp/<generation>-<random>/    a version being written; never read
    DIR/versions/<generation>/        index.faiss, chunks.jsonl, embeddings.npy, manifest.json

A version is written into tmp/, every file and the folder fsynced, renamed into versions/, and
only then is CURRENT swapped (an fsynced temp file, os.replace, fsync of DIR). A build killed at
any moment therefore leaves CURRENT naming a complete version. The manifest, written last, holds
the SHA-256 of every other file, so corruption or truncation is reported rather than served.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_VERSION = 1
CURRENT_FILE = "CURRENT"
LOCK_FILE = "LOCK"
VERSIONS_DIR = "versions"
TMP_DIR = "tmp"
INDEX_FILE = "index.faiss"
CHUNKS_FILE = "chunks.jsonl"
EMBEDDINGS_FILE = "embeddings.npy"
MANIFEST_FILE = "manifest.json"
INDEX_TYPES = ("flat", "hnsw")
HNSW_NEIGHBOURS = 32
HNSW_EF_SEARCH = 64


class IndexLoadError(RuntimeError):
    """An index directory cannot be used; the message names the problem and the file."""


class IndexLockedError(RuntimeError):
    """Another build holds the index directory's lock."""


@dataclass(frozen=True)
class StoredChunk:
    id: str
    source: str
    start: int
    end: int
    text: str
    sha256: str  # of the whole source document's text: unchanged files are matched by it


@dataclass
class IndexVersion:
    """One loaded version: manifest, chunks in FAISS row order, and the FAISS index."""

    root: Path
    version: str
    path: Path
    manifest: dict[str, Any]
    chunks: list[StoredChunk]
    index: Any  # faiss.Index
    _embeddings: np.ndarray | None = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return str(self.manifest["embedding"]["model"])

    @property
    def dim(self) -> int:
        return int(self.manifest["embedding"]["dim"])

    def embeddings(self) -> np.ndarray:
        """The stored float32 vectors (verified against the manifest), for reuse by a rebuild."""
        if self._embeddings is None:
            data = _read_verified(self.path, EMBEDDINGS_FILE, self.manifest)
            try:
                array = np.load(io.BytesIO(data), allow_pickle=False)
            except ValueError as error:
                raise IndexLoadError(f"{self.path / EMBEDDINGS_FILE} cannot be read: {error}") from error
            if array.dtype != np.float32 or array.shape != (len(self.chunks), self.dim):
                raise IndexLoadError(
                    f"{self.path / EMBEDDINGS_FILE} holds {array.dtype} {array.shape}, "
                    f"expected float32 ({len(self.chunks)}, {self.dim})"
                )
            self._embeddings = array
        return self._embeddings


def make_faiss_index(embeddings: np.ndarray, index_type: str) -> Any:
    """Inner product over unit vectors (cosine): exact ``IndexFlatIP`` or approximate HNSW."""
    import faiss

    dim = embeddings.shape[1]
    if index_type == "flat":
        index = faiss.IndexFlatIP(dim)
    elif index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = HNSW_EF_SEARCH
    else:
        raise ValueError(f"index type must be one of {', '.join(INDEX_TYPES)}, not {index_type!r}")
    if len(embeddings):
        index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
    return index


# ---------------------------------------------------------------- loading


def read_current(root: Path) -> str:
    if not root.is_dir():
        raise IndexLoadError(f"index directory {root} does not exist")
    try:
        name = (root / CURRENT_FILE).read_text().strip()
    except FileNotFoundError:
        raise IndexLoadError(f"{root} has no {CURRENT_FILE} file: not an index, or no build finished") from None
    if not name or "/" in name or name.startswith("."):
        raise IndexLoadError(f"{root / CURRENT_FILE} does not name a version: {name!r}")
    return name


def load_index(
    root: str | os.PathLike[str],
    *,
    model_name: str | None = None,
    dim: int | None = None,
    version: str | None = None,
    verify: bool = True,
) -> IndexVersion:
    """The live (or the named) version, checked against the embedder that will query it."""
    root = Path(root)
    for attempt in range(3):
        name = version or read_current(root)
        try:
            return _load_version(root, name, model_name, dim, verify)
        except IndexLoadError:
            # A concurrent build may have swapped CURRENT and collected this version meanwhile.
            if version is not None or attempt == 2 or read_current(root) == name:
                raise
    raise AssertionError("unreachable")


def read_live_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the live version's manifest: cheap, for deciding how to open the index."""
    root = Path(root)
    path = root / VERSIONS_DIR / read_current(root)
    if not path.is_dir():
        raise IndexLoadError(f"{root / CURRENT_FILE} names a version that is missing: {path}")
    return _read_manifest(path)


def _load_version(root: Path, name: str, model_name: str | None, dim: int | None, verify: bool) -> IndexVersion:
    path = root / VERSIONS_DIR / name
    if not path.is_dir():
        raise IndexLoadError(f"{root / CURRENT_FILE} names version {name!r} but {path} is missing")
    manifest = _read_manifest(path)
    _check_model(path, manifest, model_name, dim)
    chunks = _read_chunks(path, manifest, verify)
    index = _read_faiss(path, manifest, verify)
    _check_embeddings_shape(path, manifest)
    return IndexVersion(root, name, path, manifest, chunks, index)


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise IndexLoadError(f"{file} is missing") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise IndexLoadError(f"{file} is not valid JSON (corrupt or truncated): {error}") from error
    if not isinstance(manifest, dict):
        raise IndexLoadError(f"{file} is not a JSON object")
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise IndexLoadError(f"{file}: unsupported index format version {found!r} (this build reads {FORMAT_VERSION})")
    for key in ("embedding", "chunker", "index_type", "chunk_count", "files", "artifacts"):
        if key not in manifest:
            raise IndexLoadError(f"{file} lacks the {key!r} entry")
    return manifest


def _check_model(path: Path, manifest: dict[str, Any], model_name: str | None, dim: int | None) -> None:
    built_name, built_dim = manifest["embedding"].get("model"), manifest["embedding"].get("dim")
    if (model_name is not None and built_name != model_name) or (dim is not None and built_dim != dim):
        raise IndexLoadError(
            f"{path} was built with embedding model {built_name!r} ({built_dim}-d), but {model_name!r} "
            f"({dim}-d) was asked for: rebuild the index with that model, or query it with {built_name!r}"
        )


def _read_verified(path: Path, name: str, manifest: dict[str, Any]) -> bytes:
    file = path / name
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise IndexLoadError(f"{file} is missing") from None
    expected = manifest["artifacts"].get(name, {})
    if len(data) != expected.get("bytes") or hashlib.sha256(data).hexdigest() != expected.get("sha256"):
        raise IndexLoadError(
            f"{file} does not match its manifest ({len(data)} bytes, expected {expected.get('bytes')}): "
            "the file is corrupt or truncated; rebuild the index"
        )
    return data


def _read_chunks(path: Path, manifest: dict[str, Any], verify: bool) -> list[StoredChunk]:
    file = path / CHUNKS_FILE
    data = _read_verified(path, CHUNKS_FILE, manifest) if verify else _read_bytes(file)
    try:
        chunks = [StoredChunk(**json.loads(line)) for line in data.decode("utf-8").splitlines() if line]
    except (ValueError, TypeError, UnicodeDecodeError) as error:
        raise IndexLoadError(f"{file} has a malformed record (corrupt or truncated): {error}") from error
    if len(chunks) != manifest["chunk_count"]:
        raise IndexLoadError(f"{file} has {len(chunks)} chunks but the manifest says {manifest['chunk_count']}")
    return chunks


def _read_faiss(path: Path, manifest: dict[str, Any], verify: bool) -> Any:
    import faiss

    file = path / INDEX_FILE
    data = _read_verified(path, INDEX_FILE, manifest) if verify else _read_bytes(file)
    try:
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except RuntimeError as error:
        raise IndexLoadError(f"{file} cannot be read by FAISS (corrupt or truncated): {error}") from error
    if index.ntotal != manifest["chunk_count"] or index.d != manifest["embedding"]["dim"]:
        raise IndexLoadError(
            f"{file} holds {index.ntotal} vectors of dimension {index.d}, but the manifest says "
            f"{manifest['chunk_count']} of dimension {manifest['embedding']['dim']}"
        )
    return index


def _check_embeddings_shape(path: Path, manifest: dict[str, Any]) -> None:
    """Only the header and size: hashing every vector on each open would cost more than the search."""
    file = path / EMBEDDINGS_FILE
    try:
        array = np.load(file, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise IndexLoadError(f"{file} is missing") from None
    except ValueError as error:
        raise IndexLoadError(f"{file} is corrupt or truncated: {error}") from error
    if array.shape != (manifest["chunk_count"], manifest["embedding"]["dim"]):
        raise IndexLoadError(f"{file} has shape {array.shape}, which does not match the manifest")


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        raise IndexLoadError(f"{file} is missing") from None


# ---------------------------------------------------------------- writing


@contextlib.contextmanager
def build_lock(root: Path, timeout: float | None = None) -> Iterator[None]:
    """Exclusive flock on DIR/LOCK; ``timeout=None`` waits for as long as the other build takes."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / LOCK_FILE).open("a") as handle:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise IndexLockedError(f"another build holds {root / LOCK_FILE}") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_version(
    root: Path, manifest: dict[str, Any], chunks: Sequence[StoredChunk], embeddings: np.ndarray, index: Any
) -> str:
    """Write a complete version and publish it via CURRENT; the caller holds ``build_lock``."""
    import faiss

    generation = _next_generation(root)
    name = f"{generation:08d}"
    (root / TMP_DIR).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root / TMP_DIR, prefix=f"{name}-"))
    artifacts = {
        INDEX_FILE: _write_file(staging / INDEX_FILE, lambda out: out.write(faiss.serialize_index(index).tobytes())),
        CHUNKS_FILE: _write_file(staging / CHUNKS_FILE, lambda out: _write_chunks(out, chunks)),
        EMBEDDINGS_FILE: _write_file(staging / EMBEDDINGS_FILE, lambda out: np.save(out, embeddings)),
    }
    full = {**manifest, "format_version": FORMAT_VERSION, "generation": generation, "artifacts": artifacts}
    _write_file(staging / MANIFEST_FILE, lambda out: out.write(json.dumps(full, indent=2).encode()))
    staging.chmod(0o755)
    _fsync_dir(staging)
    versions = root / VERSIONS_DIR
    versions.mkdir(exist_ok=True)
    staging.rename(versions / name)
    _fsync_dir(versions)
    _replace_current(root, name)
    return name


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)


def _write_file(path: Path, write: Any) -> dict[str, Any]:
    with path.open("wb") as handle:
        writer = _HashingWriter(handle)
        write(writer)
        handle.flush()
        os.fsync(handle.fileno())
    return {"sha256": writer.digest.hexdigest(), "bytes": writer.size}


def _write_chunks(out: _HashingWriter, chunks: Sequence[StoredChunk]) -> None:
    for chunk in chunks:
        out.write((json.dumps(asdict(chunk), ensure_ascii=False) + "\n").encode("utf-8"))


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _replace_current(root: Path, name: str) -> None:
    temp = root / f".{CURRENT_FILE}.{os.getpid()}.tmp"
    with temp.open("w") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    temp.replace(root / CURRENT_FILE)  # os.replace: atomic on POSIX
    _fsync_dir(root)


def _next_generation(root: Path) -> int:
    versions = root / VERSIONS_DIR
    numbers = [int(entry.name) for entry in versions.iterdir() if entry.name.isdigit()] if versions.is_dir() else []
    return max(numbers, default=0) + 1


def current_or_none(root: Path) -> str | None:
    try:
        return read_current(root)
    except IndexLoadError:
        return None


def clean_tmp(root: Path) -> None:
    """Remove what killed builds left behind; only the lock holder may call this."""
    shutil.rmtree(root / TMP_DIR, ignore_errors=True)
    for stray in root.glob(f".{CURRENT_FILE}.*.tmp"):
        stray.unlink(missing_ok=True)


def collect_garbage(root: Path, keep: set[str]) -> list[str]:
    """Remove temp leftovers and every version not in ``keep``; returns the removed versions."""
    clean_tmp(root)
    removed = []
    versions = root / VERSIONS_DIR
    for entry in sorted(versions.iterdir()) if versions.is_dir() else []:
        if entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed
