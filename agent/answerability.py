"""Answerability probe: the target model's own P("no") to "do the passages answer this?".

Told to say when the passages lack the answer, qwen2.5-coder 0.5B and 1.5B still answered
all 14 unanswerable questions of the groundedness set from memory. Asked the same thing as a
yes/no question, the model's next-token probabilities rank those questions apart from the
answerable ones well enough to gate on; the loop then replies ``ABSTENTION`` without
generating. The threshold is the caller's (``RunOptions.abstain_threshold``): the tuned
value depends on the model, so it is measured on a dev split (``evals/groundedness/run.py``) and written
down in docs/evals.md, not guessed here.

The probe's prompt is the answer prompt's with the probe sentence appended to the user
message, so the two share every token up to the question: with the prefix cache the probe
costs a forward over the probe sentence and the answer re-prefills only the short tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specrag.agent.prompt import PromptParts, build_messages

PROBE = "Is the answer to this question stated in the passages above? Answer yes or no."
ABSTENTION = "The documents do not say."


@dataclass(frozen=True)
class AnswerTokens:
    """First-token ids of the replies that mean yes and no (case and leading-space variants)."""

    yes: tuple[int, ...]
    no: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> AnswerTokens:
        def first_ids(words: Sequence[str]) -> tuple[int, ...]:
            ids = {tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in words}
            return tuple(sorted(ids))

        yes = first_ids(["yes", "Yes", "YES", " yes", " Yes"])
        no = first_ids(["no", "No", "NO", " no", " No"])
        if set(yes) & set(no):
            raise ValueError("the tokenizer maps a yes and a no reply to the same first token")
        return cls(yes, no)


def probe_messages(parts: PromptParts) -> list[dict[str, str]]:
    """The answer prompt's messages with the probe sentence after the question."""
    messages = build_messages(parts)
    user_index = max(index for index, message in enumerate(messages) if message["role"] == "user")
    probe = dict(messages[user_index])
    probe["content"] = f"{probe['content']}\n\n{PROBE}"
    return [*messages[:user_index], probe]


def p_unanswerable(logits: torch.Tensor, tokens: AnswerTokens) -> float:
    """P(no) / (P(no) + P(yes)) of the next token: the model's answer renormalised to the two
    replies, so mass on other tokens (punctuation, a restated question) does not move it."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    log_yes = torch.logsumexp(log_probs[list(tokens.yes)], dim=0)
    log_no = torch.logsumexp(log_probs[list(tokens.no)], dim=0)
    return float(torch.sigmoid(log_no - log_yes))


class NextTokenLogits:
    """A logits processor that keeps the first logits it sees and changes nothing.

    Not ``speculative_safe`` on purpose: the probe generates one token, without speculation."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if self.logits is None:
            self.logits = logits.detach().clone()
        return logits
