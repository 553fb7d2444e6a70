"""specrag's decoder: token ids in, token ids out. Knows nothing of text or HTTP."""

from decoding.acceptance import greedy_accept, speculative_accept, speculative_accept_batch
from decoding.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from decoding.engine import Engine, GenerationEvent, GenerationRequest
from decoding.model import CausalLM, load_model
from decoding.packs import PACKS, PackChecksumError, PackError, pull
from decoding.sampling import SamplingParams, probs_from_logits
from decoding.stats import GenerationStats

__all__ = [
    "PACKS",
    "CausalLM",
    "Draft",
    "Drafter",
    "Engine",
    "GenerationEvent",
    "GenerationRequest",
    "GenerationStats",
    "ModelDrafter",
    "PackChecksumError",
    "PackError",
    "PromptLookupDrafter",
    "SamplingParams",
    "greedy_accept",
    "load_model",
    "probs_from_logits",
    "pull",
    "speculative_accept",
    "speculative_accept_batch",
]
