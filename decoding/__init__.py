"""specrag's decoder: token ids in, token ids out. Knows nothing of text or HTTP.

Names are imported lazily (PEP 562), so ``import specrag.decoding.packs`` (the CLI's pack list)
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
    "greedy_accept": "specrag.decoding.acceptance",
    "speculative_accept": "specrag.decoding.acceptance",
    "speculative_accept_batch": "specrag.decoding.acceptance",
    "Draft": "specrag.decoding.drafters",
    "Drafter": "specrag.decoding.drafters",
    "ModelDrafter": "specrag.decoding.drafters",
    "PromptLookupDrafter": "specrag.decoding.drafters",
    "Engine": "specrag.decoding.engine",
    "Grammar": "specrag.decoding.grammar",
    "GrammarCompiler": "specrag.decoding.grammar_compile",
    "UnsupportedSchemaError": "specrag.decoding.grammar_compile",
    "GenerationEvent": "specrag.decoding.request",
    "GenerationRequest": "specrag.decoding.request",
    "CausalLM": "specrag.decoding.model",
    "load_model": "specrag.decoding.model",
    "PACKS": "specrag.decoding.packs",
    "PackChecksumError": "specrag.decoding.packs",
    "PackError": "specrag.decoding.packs",
    "pull": "specrag.decoding.packs",
    "PrefixCache": "specrag.decoding.prefix_cache",
    "SamplingParams": "specrag.decoding.sampling",
    "probs_from_logits": "specrag.decoding.sampling",
    "GenerationStats": "specrag.decoding.stats",
    "CostModel": "specrag.decoding.policy",
    "PolicyConfig": "specrag.decoding.policy",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specrag.decoding' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
