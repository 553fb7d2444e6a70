"""Sampling transforms: logits in, the normalised distribution that is actually sampled out.

The same transform is applied to the target's logits and the draft's logits, so the
acceptance rule compares the two distributions that are really sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this residual mass the target and draft rows agree up to float rounding; the
# rejection that led here had probability of about this mass, so drawing from p instead
# of the (numerically meaningless) residual moves at most that much probability.
RESIDUAL_MASS_EPS = 1e-9

# As vLLM's sampler: a temperature this small is greedy. Dividing logits by a subnormal
# temperature overflows to inf, and the softmax of inf is nan.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen. ``temperature`` below ``GREEDY_BELOW`` means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the distribution sampled under ``params`` over the last dimension.

    Order as in transformers' and vLLM's samplers: temperature, then top-k, then top-p
    (top-p works on the temperature-scaled, top-k-filtered distribution). Computed in at
    least float32 whatever the model dtype, so target and draft rows are comparable.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        scaled = _mask_outside_top_k(scaled, params.top_k)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _mask_outside_top_p(probs, params.top_p)
    return probs


def _mask_outside_top_k(scaled: torch.Tensor, top_k: int) -> torch.Tensor:
    # Ties with the k-th value are kept: the rule depends only on values, so the
    # target and draft rows are filtered by the same deterministic criterion.
    kth_value = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
    return scaled.masked_fill(scaled < kth_value, float("-inf"))


def _mask_outside_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # Keep the smallest prefix of the descending order whose mass reaches top_p: a token
    # stays if the mass strictly before it is below top_p (so the top token always stays).
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    # A top_p below float32's smallest subnormal compares as 0 < 0; the top token stays anyway.
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ([..., V] -> [...]), on the probs' device."""
    flat = on_generator_device(probs.reshape(-1, probs.shape[-1]), generator)
    drawn = torch.multinomial(flat, 1, generator=generator)
    return drawn.to(probs.device).reshape(probs.shape[:-1])


def on_generator_device(tensor: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``tensor`` where ``generator`` draws (a CPU generator with CUDA logits: the draw runs
    on the CPU, so a seed gives the same tokens on every device)."""
    return tensor if generator is None else tensor.to(generator.device)


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose the next token from one row of logits: argmax when greedy, else a sample."""
    if params.greedy:
        return int(logits.argmax(dim=-1))
    return int(sample(probs_from_logits(logits, params), generator))
