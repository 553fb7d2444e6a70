"""What a caller asks the engine for, and what it streams back."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from specrag.decoding.grammar import Grammar
from specrag.decoding.policy import SPECULATION_MODES, Speculation
from specrag.decoding.sampling import SamplingParams
from specrag.decoding.stats import CycleInfo, GenerationStats

DrafterKind = Literal["lookup", "model", "both"]  # both: lookup first, the draft model when it has nothing


class LogitsProcessor(Protocol):
    """Rewrites next-token logits given the tokens before that position.

    Set ``speculative_safe = True`` on a processor that depends only on the prefix it is
    given (bans, repetition penalties): the engine then applies it to every verify row with
    that row's own prefix, and to the draft's q. Any other processor turns speculation off
    for the request (reason ``unsupported``), since it could not be applied to q.
    """

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GenerationRequest:
    prompt_tokens: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: Speculation = "auto"
    num_speculative_tokens: int = 8  # γ for "on"; auto chooses up to the engine's max_gamma
    drafter: DrafterKind | None = None  # None: the engine's default
    lookup_sources: Sequence[Sequence[int]] = ()  # passages for prompt lookup, as token ids
    lookup_source_names: Sequence[str] | None = None
    stop_token_ids: Collection[int] | None = None  # None: the target's EOS ids
    stop_sequences: Sequence[Sequence[int]] = ()  # token-id sequences that end generation
    logits_processors: Sequence[LogitsProcessor] = ()
    min_tokens_for_speculation: int | None = None  # per-endpoint override of the short-output gate
    grammar: Grammar | None = None  # constrain the output (decoding/grammar_compile.py builds one)
    tree_nodes: int | None = None  # most nodes of a draft tree; 0: chains; None: the engine's policy
    # Drafts may copy this tenant's earlier outputs, and this output joins them
    # (decoding/drafters/history.py); None: neither. Servers pass the API key's tenant.
    tenant: str | None = None


@dataclass
class GenerationEvent:
    seq_id: int
    token_ids: list[int]  # tokens committed by this cycle, in order
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    stats: GenerationStats | None = None  # on the final event
    cycle: CycleInfo | None = None
    error: Exception | None = None  # what failed this sequence alone (finish_reason "error")


def validate(request: GenerationRequest, default_drafter: DrafterKind, has_draft_model: bool) -> DrafterKind:
    """Raise ValueError naming the offending field; return the drafter kind to use."""
    if not request.prompt_tokens:
        raise ValueError("prompt_tokens must not be empty")
    if request.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if request.speculation not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {request.speculation!r}")
    if request.num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {request.num_speculative_tokens}")
    if request.tree_nodes is not None and request.tree_nodes < 0:
        raise ValueError(f"tree_nodes must be >= 0, got {request.tree_nodes}")
    if any(not stop for stop in request.stop_sequences):
        raise ValueError("stop_sequences must not contain an empty sequence")
    kind = request.drafter or default_drafter
    if kind not in ("lookup", "model", "both"):
        raise ValueError(f"drafter must be 'lookup', 'model' or 'both', got {kind!r}")
    if kind != "lookup" and not has_draft_model:
        raise ValueError(f"drafter={kind!r} needs an engine built with a draft model")
    return kind


def apply_processors(
    processors: Sequence[LogitsProcessor], prefix: Sequence[int], logits: torch.Tensor
) -> torch.Tensor:
    for processor in processors:
        logits = processor(prefix, logits)
    return logits


def speculation_supported(request: GenerationRequest) -> bool:
    return all(getattr(processor, "speculative_safe", False) for processor in request.logits_processors)
