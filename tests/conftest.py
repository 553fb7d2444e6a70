"""Shared fixtures: tiny randomly initialised models (milliseconds) and the real smollm2 pack."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specrag.decoding.model import CausalLM, load_model


def tiny_causal_lm(
    vocab_size: int = 48,
    seed: int = 0,
    hidden_size: int = 32,
    layers: int = 2,
    dtype: torch.dtype = torch.float64,
    init_scale: float = 0.6,
) -> CausalLM:
    """A randomly initialised Llama small enough that a forward takes about a millisecond.

    float64 by default, so a k-token and a one-token forward agree to ~1e-15 and greedy
    parity tests cannot be disturbed by rounding. ``init_scale`` makes logits peaked
    enough that greedy outputs are varied rather than near-uniform noise.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init_scale,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return CausalLM(model.to(dtype), tokenizer=None, name=f"tiny-{vocab_size}-{seed}")


@pytest.fixture(scope="session")
def smollm2() -> CausalLM:
    """The real smollm2-135m pack in float32 (exactness tests run in fp32)."""
    return load_model("smollm2-135m", dtype="float32", progress=False)


@pytest.fixture
def packed_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of sequences in each packed forward the engine makes during the test."""
    from specrag.decoding import step_driver

    sizes: list[int] = []
    real = step_driver.packed_forward

    def counted(lm: CausalLM, chunks: list) -> list:
        sizes.append(len(chunks))
        return real(lm, chunks)

    monkeypatch.setattr(step_driver, "packed_forward", counted)
    return sizes
