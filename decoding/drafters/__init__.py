"""Drafters propose candidate tokens for the target model to verify."""

from specrag.decoding.drafters.base import Draft, Drafter
from specrag.decoding.drafters.model_drafter import ModelDrafter
from specrag.decoding.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "PromptLookupDrafter"]
