"""Is an answer grounded in the passages it was given? The scorer, its rules, and the run check.

``scorer.GroundednessScorer`` decides per sentence (string rules, an embedding, optionally the
model as a judge); the evals report its figures and the agent uses it to mark or withhold an
answer whose claims the shown passages do not hold (``check.py``).
"""

from specrag.agent.grounding.scorer import GroundednessScorer, citation_scores, default_scorer, score
from specrag.agent.grounding.types import GroundednessResult, ScorerSettings, SentenceVerdict

__all__ = [
    "GroundednessResult",
    "GroundednessScorer",
    "ScorerSettings",
    "SentenceVerdict",
    "citation_scores",
    "default_scorer",
    "score",
]
