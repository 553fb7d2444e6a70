"""Drafters propose candidate tokens for the target model to verify."""

from decoding.drafters.base import Draft, Drafter
from decoding.drafters.model_drafter import ModelDrafter
from decoding.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter", "PromptLookupDrafter"]
