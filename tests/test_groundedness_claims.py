"""The scorer's rules for claims over documents it was not written against (issue #19), and
its support judge: each rule is shown catching its case and leaving the true sentence alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specrag.agent.answerability import AnswerTokens
from specrag.agent.grounding import GroundednessScorer, ScorerSettings
from specrag.agent.grounding import text_match as tm
from specrag.agent.grounding.support_judge import SupportJudge, judge_messages, p_yes


class FixedJudge:
    """A support judge that answers one probability and records what it was asked."""

    def __init__(self, probability: float) -> None:
        self.probability = probability
        self.asked: list[tuple[list[str], str | None, str]] = []

    def support(self, passages: Sequence[str], question: str | None, sentence: str) -> float:
        self.asked.append((list(passages), question, sentence))
        return self.probability


@pytest.fixture(scope="module")
def scorer() -> GroundednessScorer:
    return GroundednessScorer()


def verdict(scorer: GroundednessScorer, answer: str, passages: list[str], question: str | None = None):
    [sentence] = scorer.score(answer, passages, question=question).sentences
    return sentence


def test_a_number_keeps_its_unit_apart() -> None:
    assert tm.numbers("30ms by default, blocks of 2h, 64MB", words=False) == {"30", "2", "64"}
    assert tm.numbers("abc123 and U+007F", words=False) == set()


def test_a_number_taken_from_another_passage_is_not_support(scorer: GroundednessScorer) -> None:
    retries = "Remote write retries a failed request with a backoff that doubles each time."
    retention = "Samples are kept for 15 days by default."
    borrowed = verdict(
        scorer, "Remote write retries a failed request 15 times, with a doubling backoff.", [retries, retention]
    )
    assert borrowed.supported is False and "stated about something else" in borrowed.reason
    right = verdict(scorer, "By default samples are kept for 15 days.", [retries, retention])
    assert right.supported is True


def test_a_setting_named_in_code_is_the_one_the_prose_spells_out(scorer: GroundednessScorer) -> None:
    passage = "Increasing min shards will allow Prometheus to avoid falling behind at the beginning."
    spelled = verdict(
        scorer, "Raising min_shards allows Prometheus to avoid falling behind at the beginning.", [passage]
    )
    assert spelled.supported is True, spelled.reason
    other = verdict(scorer, "Raising max_shards allows Prometheus to avoid falling behind at the beginning.", [passage])
    assert other.supported is False and "max_shards" in other.reason


def test_a_product_named_where_the_evidence_names_another_is_unsupported(scorer: GroundednessScorer) -> None:
    node = "For batch jobs tied to a machine, use the Node Exporter's textfile collector instead of the Pushgateway."
    snmp = "The SNMP Exporter lets you monitor network devices that speak SNMP."
    swapped = "For batch jobs tied to a machine, use the SNMP Exporter's textfile collector instead of the Pushgateway."
    result = verdict(scorer, swapped, [node, snmp])
    assert result.supported is False and "name snmp where the passage says node" in result.reason
    assert verdict(scorer, node, [node, snmp]).supported is True


def test_a_word_flipped_to_its_opposite_is_unsupported(scorer: GroundednessScorer) -> None:
    passage = "* `operations` is a list of operations that were applied to the metric, newest operation first."
    flipped = verdict(
        scorer, "operations lists the operations applied to the metric, oldest operation first.", [passage]
    )
    assert flipped.supported is False and "'oldest' where the evidence says 'newest'" in flipped.reason
    kept = verdict(scorer, "operations lists the operations applied to the metric, newest operation first.", [passage])
    assert kept.supported is True


def test_a_negation_the_evidence_lacks_is_unsupported_even_beside_a_second_clause(scorer: GroundednessScorer) -> None:
    passage = "A single Prometheus is fast. You can run Prometheus reliably with tens of millions of active series."
    added = (
        "You cannot run a single Prometheus reliably with tens of millions of active series, so plan to shard early."
    )
    result = verdict(scorer, added, [passage])
    assert result.supported is False and result.reason.startswith(tm.CLAIM_NEGATES)


def test_restating_the_question_is_not_an_answer(scorer: GroundednessScorer) -> None:
    question = "What does the honor_labels option do?"
    passage = (
        "honor_labels controls how Prometheus handles conflicts between labels already present in scraped data "
        "and labels that Prometheus would attach server-side."
    )
    circular = "The honor_labels option determines how Prometheus honors labels, according to how honor_labels is set."
    result = verdict(scorer, circular, [passage], question)
    assert result.supported is False and result.reason.startswith("restates the question")
    assert verdict(scorer, circular, [passage]).reason != result.reason  # without the question, no such rule
    answer = (
        "honor_labels controls how Prometheus handles conflicts between scraped labels and the labels it attaches "
        "server-side."
    )
    assert verdict(scorer, answer, [passage], question).supported is True


def test_a_restatement_that_names_the_answer_is_an_answer(scorer: GroundednessScorer) -> None:
    question = "For `assert cond, msg`, what exception is raised when cond is false?"
    passage = "If the expression is false, assert raises AssertionError with msg as its argument."
    named = "The exception raised when `cond` is false is `AssertionError`."
    assert verdict(scorer, named, [passage], question).supported is True
    unnamed = "The exception raised when `cond` is false is the exception that assert raises."
    assert verdict(scorer, unnamed, [passage], question).reason.startswith("restates the question")


def test_a_quoted_value_the_question_does_not_say_is_an_answer(scorer: GroundednessScorer) -> None:
    question = "On what HTTP path does Prometheus expect a target to expose its metrics by default?"
    passage = "By default, Prometheus scrapes the HTTP path /metrics of every target it is given."
    named = "The default HTTP path for Prometheus to expose its metrics is `/metrics`."
    assert verdict(scorer, named, [passage], question).supported is True


def test_a_short_answer_is_judged_as_the_answer_to_its_question() -> None:
    passages = ["The Prometheus server listens on port 9090.", "The node exporter listens on port 9100."]
    question = "Which port does Prometheus listen on by default?"
    alone = GroundednessScorer()
    assert verdict(alone, "9100.", passages, question).supported is None  # only a judge can tell
    assert verdict(alone, "8080.", passages, question).supported is False  # in no passage
    doubting, sure = FixedJudge(0.1), FixedJudge(0.9)
    assert (
        verdict(GroundednessScorer(embedder=alone.embedder, judge=doubting), "9100.", passages, question).supported
        is False
    )
    assert (
        verdict(GroundednessScorer(embedder=alone.embedder, judge=sure), "9090.", passages, question).supported is True
    )
    assert doubting.asked == [(passages, question, "9100.")]


def test_the_judge_overrules_the_rules_only_below_its_threshold(scorer: GroundednessScorer) -> None:
    passage = "Prometheus scrapes targets over HTTP at a configured interval."
    claim = "Prometheus scrapes its targets over HTTP at a configured interval."
    settings = ScorerSettings(min_judge_support=0.5)
    low, high = FixedJudge(0.3), FixedJudge(0.7)
    vetoed = verdict(GroundednessScorer(settings, scorer.embedder, judge=low), claim, [passage])
    assert vetoed.supported is False and vetoed.reason == "judge: P(yes) 0.30"
    kept = verdict(GroundednessScorer(settings, scorer.embedder, judge=high), claim, [passage])
    assert kept.supported is True and kept.reason.endswith("judge P(yes) 0.70")
    unasked = FixedJudge(0.99)
    wrong = verdict(
        GroundednessScorer(settings, scorer.embedder, judge=unasked),
        "Prometheus scrapes targets over 7 protocols.",
        [passage],
    )
    assert wrong.supported is False and not unasked.asked  # a rule's "no" is final: the judge is not asked


def test_the_judge_prompt_shows_passages_first_and_reads_yes_against_no() -> None:
    messages = judge_messages(["alpha passage", "beta passage"], "Which?", "A claim.")
    user = messages[-1]["content"]
    assert (
        user.index("[P1] alpha")
        < user.index("[P2] beta")
        < user.index("Question: Which?")
        < user.index("Statement: A claim.")
    )
    tokens = AnswerTokens(yes=(1,), no=(2,))
    logits = torch.tensor([5.0, 1.0, 1.0 + torch.log(torch.tensor(3.0)).item()])
    assert p_yes(logits, tokens) == pytest.approx(0.25)  # yes : no = 1 : 3, the third token's mass ignored


def test_the_judge_takes_the_best_single_passage(monkeypatch: pytest.MonkeyPatch) -> None:
    judge = SupportJudge.__new__(SupportJudge)
    answers = {"first": 0.2, "second": 0.8, "third": 0.5}
    monkeypatch.setattr(judge, "_ask", lambda passages, question, sentence: answers[passages[0]])
    assert judge.support(["first", "second", "third"], None, "claim") == 0.8


class AnsweringJudge(FixedJudge):
    """A judge that also answers questions: a short answer must agree with its answer."""

    def __init__(self, own_answer: str) -> None:
        super().__init__(0.99)
        self.own_answer = own_answer

    def answer(self, passages: Sequence[str], question: str) -> str:
        return self.own_answer


def test_a_short_answer_must_agree_with_the_judges_own_answer(scorer: GroundednessScorer) -> None:
    passages = ["The Prometheus server listens on port 9090.", "The node exporter listens on port 9100."]
    question = "Which port does Prometheus listen on by default?"
    judge = GroundednessScorer(embedder=scorer.embedder, judge=AnsweringJudge("9090"))
    assert verdict(judge, "9090.", passages, question).supported is True
    wrong = verdict(judge, "9100.", passages, question)
    assert wrong.supported is False and "disagrees" in wrong.reason


@pytest.mark.parametrize(
    "given, own, agree",
    [
        ("9100.", "9090", False),
        ("Every 15 seconds.", "15 seconds", True),
        ("The Pushgateway.", "Pushgateway", True),
        ("The Pushgateway.", "the Prometheus server behind the firewall", False),
        ("Those beginning with __ (two underscores).", "`__`", True),
        ("Not at all.", "no", False),  # "no" is not a word of "not at all"
        ("Pushgateway.", "", False),
    ],
)
def test_short_answers_agree_on_numbers_whole_words_or_half_their_words(given: str, own: str, agree: bool) -> None:
    assert tm.short_answers_agree(given, own) is agree


def test_the_eval_scores_an_answer_against_its_question(scorer: GroundednessScorer) -> None:
    from specrag.evals.groundedness.metrics import answer_scores

    run = {
        "answer": "9100.",
        "question": "Which port does Prometheus listen on by default?",
        "passages": [
            {"label": "P1", "text": "The Prometheus server listens on port 9090."},
            {"label": "P2", "text": "The node exporter listens on port 9100."},
        ],
        "answerable": True,
        "reference": "9090",
    }
    judged = answer_scores(run, GroundednessScorer(embedder=scorer.embedder, judge=AnsweringJudge("9090")))
    assert judged["groundedness"] == 0.0 and judged["scorable_sentences"] == 1
    assert answer_scores(run, scorer)["scorable_sentences"] == 0  # no judge: a bare value is not scored
