"""Lossless acceptance of drafted tokens (contract in docs/design.md).

Pure functions over tensors. Randomness only ever comes from the explicit
``torch.Generator`` argument, never the global RNG.

Greedy rule: plain greedy decoding commits argmax(target) at every position, so the
accepted prefix is the longest run of draft tokens equal to those argmaxes, followed by
the target's argmax at the first mismatch (or at the bonus position when all match).

Sampling rule (Leviathan et al. 2023; Chen et al. 2023): draft token x at position i,
drawn from q_i, is accepted with probability min(1, p_i(x) / q_i(x)). At the first
rejection the committed token is drawn from the residual norm(max(0, p_i - q_i)); if all
γ are accepted the bonus token is drawn from p_γ. Nothing after the first rejection is
committed. The committed tokens are then distributed exactly as samples from p.
"""

from __future__ import annotations

import torch

from specrag.decoding.drafters.base import Draft
from specrag.decoding.sampling import (
    RESIDUAL_MASS_EPS,
    SamplingParams,
    on_generator_device,
    probs_from_logits,
    select_token,
)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Greedy verification. ``draft_tokens`` [γ], ``target_logits`` [γ+1, V].

    Returns ``(accepted_len, committed)`` with ``committed`` = accepted prefix + one
    target token, so ``len(committed) == accepted_len + 1``.
    """
    gamma = draft_tokens.shape[0]
    target_choice = target_logits.argmax(dim=-1)
    matches = (draft_tokens == target_choice[:gamma]).to(torch.int64)
    accepted_len = int(matches.cumprod(dim=0).sum())
    # On the accepted prefix the draft equals the target's choice, so one slice suffices.
    return accepted_len, target_choice[: accepted_len + 1].clone()


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, torch.Tensor]:
    """Sampling verification for one sequence.

    ``draft_tokens`` [γ], ``draft_probs`` [γ, V] (one-hot for a deterministic drafter),
    ``target_probs`` [γ+1, V]; both distributions already transformed (temperature,
    top-k, top-p, grammar mask) and normalised. Returns ``(accepted_len, committed)``.
    """
    accepted_len, next_token = speculative_accept_batch(
        draft_tokens[None], draft_probs[None], target_probs[None], generator
    )
    accepted = int(accepted_len[0])
    committed = torch.cat([draft_tokens[:accepted], next_token])
    return accepted, committed


def speculative_accept_batch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched form: [B, γ], [B, γ, V], [B, γ+1, V] -> (accepted_len [B], next_token [B]).

    The committed tokens of row b are ``draft_tokens[b, :accepted_len[b]]`` then
    ``next_token[b]``.
    """
    batch, gamma = draft_tokens.shape
    q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept_prob = _acceptance_probability(draft_tokens, draft_probs, target_probs)
    draw_device = accept_prob.device if generator is None else generator.device
    uniforms = torch.rand((batch, gamma), generator=generator, dtype=accept_prob.dtype, device=draw_device)
    accepted = (uniforms.to(accept_prob.device) < accept_prob).to(torch.int64)
    accepted_len = accepted.cumprod(dim=-1).sum(dim=-1)

    rows = torch.arange(batch, device=draft_tokens.device)
    # A zero row at index γ turns the residual at the bonus position into p itself.
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, target_probs.shape[-1])], dim=1)
    q_at_stop = q_padded[rows, accepted_len]
    # A token the draft gave q(x) = 0 is rejected with certainty, so the committed token
    # must be a plain sample from p: drop q from the residual there.
    q_of_stop_token = torch.cat([q_of_draft, q_of_draft.new_ones(batch, 1)], dim=1)[rows, accepted_len]
    q_at_stop = q_at_stop * (q_of_stop_token > 0)[:, None]
    stop_dist = _residual_distribution(target_probs[rows, accepted_len], q_at_stop)
    next_token = torch.multinomial(on_generator_device(stop_dist, generator), 1, generator=generator)
    next_token = next_token.to(draft_tokens.device).squeeze(-1)
    return accepted_len, next_token


def _acceptance_probability(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """min(1, p(x) / q(x)) per drafted position; 0 where q(x) = 0 ([B, γ])."""
    gamma = draft_tokens.shape[1]
    p_of_draft = target_probs[:, :gamma].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = p_of_draft / q_of_draft.clamp_min(torch.finfo(q_of_draft.dtype).tiny)
    return torch.where(q_of_draft > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


def _residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row, or p where that residual has (numerically) no mass."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    no_mass = mass <= RESIDUAL_MASS_EPS
    return torch.where(no_mass, p, residual / mass.clamp_min(RESIDUAL_MASS_EPS))


def accept_draft(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[int, list[int]]:
    """Verify one sequence's draft against its target rows [γ+1, V] (processors and masks
    applied) by the rule its sampling parameters call for; a deterministic drafter's q is
    one-hot on its token. Returns ``(accepted_len, committed tokens)``."""
    if not draft.tokens:  # γ = 0, a plain step: the rule reduces to choosing from p itself
        return 0, [select_token(target_logits[-1], sampling, generator)]
    draft_tokens = torch.tensor(draft.tokens, dtype=torch.long, device=target_logits.device)
    if sampling.greedy:
        accepted_len, committed = greedy_accept(draft_tokens, target_logits)
        return accepted_len, committed.tolist()
    target_probs = probs_from_logits(target_logits, sampling)
    if draft.probs is None:
        draft_probs = target_probs.new_zeros(len(draft.tokens), target_probs.shape[-1])
        draft_probs.scatter_(1, draft_tokens[:, None], 1.0)
    else:
        draft_probs = draft.probs.to(target_probs.device)
    accepted_len, committed = speculative_accept(draft_tokens, draft_probs, target_probs, generator)
    return accepted_len, committed.tolist()
