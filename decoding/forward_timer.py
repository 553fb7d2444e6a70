"""Timing target or draft forwards for the cost model (``Engine.calibrate``)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from specrag.decoding.kv import SequenceKV
from specrag.decoding.model import CausalLM
from specrag.decoding.policy import BUDGET_TOKEN_COUNTS

_CALIBRATION_CONTEXT = 256  # tokens of synthetic context the cost model is measured at


class ForwardTimer:
    """Times forwards over k new tokens after a fixed synthetic context, prefilled once."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        generator = torch.Generator().manual_seed(0)
        extra = max(64, *BUDGET_TOKEN_COUNTS)
        self.ids = torch.randint(0, model.vocab_size, (_CALIBRATION_CONTEXT + extra,), generator=generator).tolist()
        self.kv: SequenceKV | None = None

    def __call__(self, tokens: int) -> float:
        """A forward over ``tokens`` new tokens with every row's logits (a verify)."""
        return self._timed(tokens, prompt=False)

    def prompt(self, tokens: int) -> float:
        """A prompt chunk of ``tokens``: prompt attention, the last row's logits only."""
        return self._timed(tokens, prompt=True)

    def tree(self, tokens: int, paths: int) -> float:
        """A verify over ``tokens`` rows: the pending token and a draft tree of ``paths``
        equal chains under it (the packed forward, the only one that verifies trees)."""
        from specrag.decoding.packed import Chunk, packed_forward
        from specrag.decoding.tree_attention import TreeRows

        nodes = tokens - 1
        parents: list[int] = []
        for path in range(paths):
            length = nodes // paths + (path < nodes % paths)
            parents += [-1, *range(len(parents), len(parents) + length - 1)] if length else []
        tree = TreeRows.of(parents)
        return self._timed(
            tokens, prompt=False, run=lambda kv, ids: packed_forward(self.model, [Chunk(kv, ids, tree=tree)])
        )

    def _timed(self, tokens: int, prompt: bool, run: Callable[[SequenceKV, list[int]], object] | None = None) -> float:
        if self.kv is None:
            self.kv = self.model.new_kv()
            self.model.prefill(self.kv, self.ids[:_CALIBRATION_CONTEXT])
        new_tokens = self.ids[_CALIBRATION_CONTEXT : _CALIBRATION_CONTEXT + tokens]
        start = time.perf_counter()
        if run is not None:
            run(self.kv, new_tokens)
        elif prompt:
            self.model.forward_prompt(self.kv, new_tokens)
        else:
            self.model.forward(self.kv, new_tokens)
        seconds = time.perf_counter() - start
        self.kv.crop(_CALIBRATION_CONTEXT)
        return seconds


_PROMPT_COSTS: weakref.WeakKeyDictionary[CausalLM, dict[int, float]] = weakref.WeakKeyDictionary()


def prompt_costs(model: CausalLM) -> dict[int, float]:
    """Seconds of one prompt chunk of each of ``BUDGET_TOKEN_COUNTS`` tokens, timed once per
    model and process (the step budget's curve is the model's and the machine's, not an
    engine's; each engine re-measures only its short forwards)."""
    if model not in _PROMPT_COSTS:
        timer = ForwardTimer(model)
        timer.prompt(BUDGET_TOKEN_COUNTS[0])  # warm-up: first calls allocate
        _PROMPT_COSTS[model] = {count: timer.prompt(count) for count in BUDGET_TOKEN_COUNTS}
    return dict(_PROMPT_COSTS[model])
