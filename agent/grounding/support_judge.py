"""The target model as a local judge: do the shown passages support this sentence?

The groundedness scorer's string and embedding rules catch what they can see (a number or a
name in no passage, a dropped negation), but a claim that reuses the passages' words with a
changed meaning (a flipped comparison, a fact moved to another document, a restated
question) passes them. For those the model that wrote the answer is asked a yes/no
question, and its next-token probabilities are read as P(yes), as the answerability probe
reads P(no): one forward, no generation, no download.

The prompt puts the passages first and the question and sentence last, so the sentences of
one answer share every token up to the question: with the engine's prefix cache, judging a
second sentence costs a forward over that sentence and the question, not the passages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from specrag.agent.answerability import AnswerTokens, NextTokenLogits, p_unanswerable
from specrag.agent.prompt import encode_messages
from specrag.decoding import GenerationEvent, GenerationRequest

JUDGE_SYSTEM = "You are a careful fact checker. You compare a statement with passages and reply yes or no."
JUDGE_ASK = (
    "Do the passages state everything the statement says, about the same subject? "
    "A statement that only repeats the question, or answers it wrongly, is not supported. "
    "Answer yes or no."
)

ANSWER_SYSTEM = "Answer the question from the passages only, in a few words."
ANSWER_TOKENS = 24


def judge_messages(passages: Sequence[str], question: str | None, sentence: str) -> list[dict[str, str]]:
    """Passages first (shared between the sentences of one answer), then the claim and the ask."""
    shown = "\n\n".join(f"[P{index}] {text.strip()}" for index, text in enumerate(passages, start=1))
    asked = f"Question: {question.strip()}\n" if question else ""
    user = f"Passages:\n{shown}\n\n{asked}Statement: {sentence.strip()}\n\n{JUDGE_ASK}"
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def p_yes(logits: torch.Tensor, tokens: AnswerTokens) -> float:
    """P(yes) / (P(yes) + P(no)) of the next token: the probe's P(no) read the other way."""
    return 1.0 - p_unanswerable(logits, tokens)


class SupportJudge:
    """``support(passages, question, sentence) -> P(supported)`` from one forward of the model.

    ``generate``: the engine's (or the agent's) generate, ideally over a prefix cache.
    """

    def __init__(
        self, tokenizer: Any, generate: Callable[[GenerationRequest], Iterator[GenerationEvent]], name: str = ""
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self._generate = generate
        self._tokens = AnswerTokens.of(tokenizer)

    @classmethod
    def for_model(cls, model: str, dtype: str = "auto") -> SupportJudge:
        """A judge with its own engine and prefix cache over ``model`` (a pack name)."""
        from specrag.decoding import Engine, load_model

        lm = load_model(model, dtype=dtype, progress=False)
        engine = Engine(lm, prefix_cache=True)
        return cls(lm.tokenizer, engine.generate, name=model)

    def support(self, passages: Sequence[str], question: str | None, sentence: str) -> float:
        """The most any one passage supports the sentence: each is asked alone, since with all
        of them in view the model credits a number or a name another passage holds (on the
        Prometheus dev claims, AUROC 0.81 for the best single passage against 0.71 for all
        passages at once)."""
        return max((self._ask([passage], question, sentence) for passage in passages), default=0.0)

    def answer(self, passages: Sequence[str], question: str) -> str:
        """The model's own short answer to ``question`` from ``passages`` (greedy): a bare
        answer is checked by agreeing with it, which P(yes) could not do (on the dev claims
        it told 9 of 10 right and wrong short answers apart; P(yes) overlapped)."""
        shown = "\n\n".join(f"[P{index}] {text.strip()}" for index, text in enumerate(passages, start=1))
        messages = [
            {"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": f"Passages:\n{shown}\n\nQuestion: {question.strip()}"},
        ]
        request = GenerationRequest(encode_messages(self.tokenizer, messages), max_tokens=ANSWER_TOKENS)
        token_ids = [token for event in self._generate(request) for token in event.token_ids]
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True)).strip()

    def _ask(self, passages: Sequence[str], question: str | None, sentence: str) -> float:
        prompt = encode_messages(self.tokenizer, judge_messages(passages, question, sentence))
        capture = NextTokenLogits()
        request = GenerationRequest(prompt, max_tokens=1, speculation="off", logits_processors=[capture])
        for _ in self._generate(request):
            pass
        assert capture.logits is not None
        return p_yes(capture.logits, self._tokens)
