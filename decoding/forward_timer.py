"""Timing target or draft forwards for the cost model (``Engine.calibrate``)."""

from __future__ import annotations

import time

import torch

from decoding.kv import SequenceKV
from decoding.model import CausalLM

_CALIBRATION_CONTEXT = 256  # tokens of synthetic context the cost model is measured at


class ForwardTimer:
    """Times forwards over k new tokens after a fixed synthetic context, prefilled once."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, model.vocab_size, (_CALIBRATION_CONTEXT + 64,), generator=generator).tolist()
        self.kv: SequenceKV | None = None

    def __call__(self, tokens: int) -> float:
        if self.kv is None:
            self.kv = self.model.new_kv()
            self.model.prefill(self.kv, self.ids[:_CALIBRATION_CONTEXT])
        start = time.perf_counter()
        self.model.forward(self.kv, self.ids[_CALIBRATION_CONTEXT : _CALIBRATION_CONTEXT + tokens])
        seconds = time.perf_counter() - start
        self.kv.crop(_CALIBRATION_CONTEXT)
        return seconds
