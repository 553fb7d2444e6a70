"""specrag's decoder: token ids in, token ids out. Knows nothing of text or HTTP.

Names are imported lazily (PEP 562), so ``import decoding.packs`` (the CLI's pack list)
does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Before anything imports transformers or huggingface_hub, which read it once: no code
# path of specrag may reach a model hub unless the user explicitly allows it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_EXPORTS = {
    "greedy_accept": "decoding.acceptance",
    "speculative_accept": "decoding.acceptance",
    "speculative_accept_batch": "decoding.acceptance",
    "Draft": "decoding.drafters",
    "Drafter": "decoding.drafters",
    "ModelDrafter": "decoding.drafters",
    "PromptLookupDrafter": "decoding.drafters",
    "Engine": "decoding.engine",
    "Grammar": "decoding.grammar",
    "GrammarCompiler": "decoding.grammar_compile",
    "UnsupportedSchemaError": "decoding.grammar_compile",
    "GenerationEvent": "decoding.request",
    "GenerationRequest": "decoding.request",
    "CausalLM": "decoding.model",
    "load_model": "decoding.model",
    "PACKS": "decoding.packs",
    "PackChecksumError": "decoding.packs",
    "PackError": "decoding.packs",
    "pull": "decoding.packs",
    "PrefixCache": "decoding.prefix_cache",
    "SamplingParams": "decoding.sampling",
    "probs_from_logits": "decoding.sampling",
    "GenerationStats": "decoding.stats",
    "CostModel": "decoding.policy",
    "PolicyConfig": "decoding.policy",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decoding' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
