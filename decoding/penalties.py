"""Repetition penalties as a speculative-safe logits processor: token ids in, logits out.

Two families, as the OpenAI API and vLLM define them:

- OpenAI ``frequency_penalty`` f and ``presence_penalty`` p over the tokens generated so
  far (not the prompt): ``logit[t] -= f * count[t] + p * (count[t] > 0)``.
- ``repetition_penalty`` r (CTRL, transformers, vLLM) over every token seen, prompt and
  output: a seen token's logit is divided by r when positive and multiplied by r when not,
  so r > 1 always makes it less likely.

The penalised logits depend only on the prefix a row follows, so the engine applies the
processor to every verify row with that row's own prefix (committed tokens plus the drafts
before it) and to the draft model's q: speculation stays exact against the penalised
target, greedy or sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition}")

    @property
    def active(self) -> bool:
        return self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0


def penalize(logits: torch.Tensor, seen: torch.Tensor, generated: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """``logits`` (..., vocab) penalised for ``seen`` (prompt and output ids) and
    ``generated`` (output ids only), in the order vLLM applies them: repetition, then
    frequency and presence. Returns a new tensor."""
    vocab = logits.shape[-1]
    out = logits.clone()
    if penalties.repetition != 1.0 and seen.numel():
        ids = torch.unique(seen[seen < vocab])
        chosen = out[..., ids]
        out[..., ids] = torch.where(chosen > 0, chosen / penalties.repetition, chosen * penalties.repetition)
    if (penalties.frequency or penalties.presence) and generated.numel():
        counts = torch.bincount(generated[generated < vocab], minlength=vocab).to(out.dtype)
        out -= penalties.frequency * counts + penalties.presence * (counts > 0).to(out.dtype)
    return out


class PenaltyProcessor:
    """``Penalties`` for one request whose prompt is the first ``prompt_length`` ids of
    every prefix the engine passes."""

    speculative_safe = True

    def __init__(self, penalties: Penalties, prompt_length: int) -> None:
        self.penalties = penalties
        self.prompt_length = prompt_length

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        seen = torch.as_tensor(list(token_ids), dtype=torch.long, device=logits.device)
        return penalize(logits, seen, seen[self.prompt_length :], self.penalties)
