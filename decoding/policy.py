"""How many tokens to draft this cycle, or why not to draft at all.

``off`` never drafts; ``on`` drafts a fixed γ; ``auto`` drafts the configured γ for now
(the measured cost model and recovering gates arrive with the speed issue). Every
plain step taken in a speculative mode records its reason in ``GenerationStats``.
"""

from __future__ import annotations

from typing import Literal

Speculation = Literal["auto", "on", "off"]
SPECULATION_MODES: tuple[str, ...] = ("auto", "on", "off")

OFF_BY_REQUEST = "off"
NEAR_MAX_TOKENS = "max_tokens"  # one token left: a verify could commit no more than a plain step
NO_PROPOSAL = "no_proposal"  # the drafter had nothing to offer


def choose_gamma(mode: Speculation, max_gamma: int, remaining_tokens: int) -> tuple[int, str | None]:
    """Return (γ, reason); γ = 0 means a plain step, and reason says why."""
    if mode == "off":
        return 0, OFF_BY_REQUEST
    # A cycle commits at most γ + 1 tokens; drafting past max_tokens only wastes verify work.
    gamma = min(max_gamma, remaining_tokens - 1)
    if gamma <= 0:
        return 0, NEAR_MAX_TOKENS
    return gamma, None
