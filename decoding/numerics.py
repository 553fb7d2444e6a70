"""When may speculative greedy output differ from plain greedy output? Only at near-ties.

A forward over k new tokens does not round exactly like k one-token forwards (other GEMM
shapes, other accumulation order). In float32 the difference is ~1e-6 of a logit and
greedy outputs stayed identical in every run here; in bfloat16 it is a few ulps, and an
argmax can flip where the top two logits are that close. This module states how close
counts as a near-tie, and finds the first divergence and the gap plain decoding saw there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrag.decoding.model import CausalLM

BF16_SIGNIFICAND_BITS = 8  # 7 stored + the implicit bit


def bf16_ulp(value: float) -> float:
    """Spacing of bfloat16 numbers at ``value``: 2^(exponent - 7)."""
    if value == 0:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(abs(value))) - (BF16_SIGNIFICAND_BITS - 1))


def near_tie_tolerance(top_logit: float, num_layers: int) -> float:
    """Largest top-2 logit gap that bf16 rounding can plausibly close between the k-token
    and one-token forwards, at this logit scale:

        tolerance = 2 * sqrt(num_layers) * ulp_bf16(|top logit|)

    Each of the L layers writes its output to the residual stream rounded to bf16, and the
    two kernels round differently, so each layer adds an independent error of about one ulp
    at the stream's scale; independent errors add like a random walk, sqrt(L) ulps. The
    logits inherit that relative error at their own scale, hence ulp(|top logit|). A flip
    needs top-1 and top-2 to move toward each other, hence the factor 2. For SmolLM2-135M
    (30 layers) at a top logit of 25 this is 2 * 5.48 * 0.125 = 1.37; the largest
    per-logit difference measured there between the two paths was 6.5 ulps (0.81).
    """
    return 2.0 * math.sqrt(num_layers) * bf16_ulp(top_logit)


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the output where the two runs first differ
    plain_top2_gap: float  # top-1 minus top-2 logit that plain decoding saw there
    top_logit: float
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.plain_top2_gap <= self.tolerance


def first_difference(plain: Sequence[int], other: Sequence[int]) -> int | None:
    """First index where the outputs differ (a length difference counts), or None."""
    for position, (left, right) in enumerate(zip(plain, other, strict=False)):
        if left != right:
            return position
    return None if len(plain) == len(other) else min(len(plain), len(other))


def plain_logits_at(model: CausalLM, prompt: Sequence[int], plain_output: Sequence[int], position: int) -> torch.Tensor:
    """Logits from which plain decoding chose ``plain_output[position]``, recomputed along
    exactly the plain path: a prefill of the prompt, then one-token forwards."""
    kv = model.new_kv()
    logits = model.prefill(kv, prompt)
    for token in plain_output[:position]:
        logits = model.forward(kv, [token], last_only=True)[-1]
    return logits


def find_divergence(
    model: CausalLM, prompt: Sequence[int], plain_output: Sequence[int], other_output: Sequence[int]
) -> Divergence | None:
    position = first_difference(plain_output, other_output)
    if position is None or position >= len(plain_output):
        return None
    top2 = plain_logits_at(model, prompt, plain_output, position).topk(2).values
    top_logit = float(top2[0])
    num_layers = int(getattr(model.config, "num_hidden_layers", 1))
    return Divergence(position, float(top2[0] - top2[1]), top_logit, near_tie_tolerance(top_logit, num_layers))
