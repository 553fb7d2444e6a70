"""End to end through the engine: speculative sampling with a model drafter, and over
prompt lookup's draft trees, samples the target model's own distribution (tiny models, so
the exact distribution is computable), on batched steps: ten requests share every packed
target and draft forward."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from unittest import mock

import pytest
import scipy.stats
import torch
import xgrammar as xgr

from specrag.decoding import Engine, GenerationRequest, SamplingParams, acceptance, step_driver, tree
from specrag.decoding.grammar import Grammar, GrammarState
from specrag.decoding.grammar_compile import GrammarCompiler
from specrag.decoding.model import CausalLM
from specrag.decoding.policy import PolicyConfig
from specrag.decoding.sampling import probs_from_logits
from specrag.decoding.stats import GenerationStats
from specrag.decoding.tree import node_depths
from tests.conftest import tiny_causal_lm

VOCAB = 6
TARGET = tiny_causal_lm(VOCAB, seed=21, init_scale=0.4)
DRAFT = tiny_causal_lm(VOCAB, seed=22, init_scale=0.4, hidden_size=16, layers=1)
PROMPT = [1, 4, 2]
PARAMS = SamplingParams(temperature=1.0, top_k=5)
RUNS = 2500
BATCH = 10  # requests sharing each step


def exact_second_and_third_token() -> torch.Tensor:
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), as [V, V]."""

    def probs(tokens: list[int]) -> torch.Tensor:
        return probs_from_logits(TARGET.forward(TARGET.new_kv(), tokens)[-1], PARAMS)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = probs(PROMPT)
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        second = probs([*PROMPT, t1])
        joint[t2] += first[t1] * second[t2] * probs([*PROMPT, t1, t2])
    return joint


def batched_pair_counts(
    engine: Engine,
    request_for: Callable[[int], GenerationRequest],
    on_finish: Callable[[GenerationStats], None],
    allow_errors: bool = False,
) -> tuple[torch.Tensor, int]:
    """(second, third) token counts over RUNS seeded requests (``request_for(seed)``), BATCH
    at a time in one engine, so they share packed steps; each finished request's stats go
    to ``on_finish``. With ``allow_errors`` (a planted bug) a request that fails is counted
    apart; the second value is how many did."""
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    errors = 0
    for first in range(0, RUNS, BATCH):
        outputs = {engine.add(request_for(seed)): [] for seed in range(first, min(first + BATCH, RUNS))}
        while engine.has_unfinished():
            for event in engine.step():
                outputs[event.seq_id] += event.token_ids
                if event.finished and event.error is not None:
                    assert allow_errors, event.error
                    errors += 1
                    del outputs[event.seq_id]
                elif event.finished:
                    assert event.stats is not None
                    on_finish(event.stats)
        for output in outputs.values():
            counts[output[1], output[2]] += 1
    return counts, errors


def sampled_request(
    seed: int, grammar: Grammar | None = None, lookup_sources: Sequence[Sequence[int]] = ()
) -> GenerationRequest:
    """One seeded request of the sampled-distribution tests: PROMPT, 4 tokens, speculation on."""
    return GenerationRequest(
        PROMPT,
        max_tokens=4,
        speculation="on",
        num_speculative_tokens=2,
        stop_token_ids=[],
        sampling=SamplingParams(temperature=1.0, top_k=5, seed=seed),
        lookup_sources=lookup_sources,
        grammar=grammar,
    )


def sampled_second_and_third_token(grammar: Grammar | None = None) -> torch.Tensor:
    """RUNS seeded requests, BATCH at a time in one engine, so they share packed steps
    (target and draft forwards alike): the distribution is checked on batched steps."""
    engine = Engine(TARGET, DRAFT, default_drafter="model")
    speculated = rejections = widest = 0
    real = step_driver.packed_forward

    def counted(lm: object, chunks: list) -> list:
        nonlocal widest
        widest = max(widest, len(chunks))
        return real(lm, chunks)

    def on_finish(stats: GenerationStats) -> None:
        nonlocal speculated, rejections
        speculated += stats.drafted_tokens > 0
        rejections += stats.wasted_verify_tokens > 0

    with packing(TARGET, DRAFT), mock.patch.object(step_driver, "packed_forward", counted):
        counts, _ = batched_pair_counts(engine, partial(sampled_request, grammar=grammar), on_finish)
    assert widest == BATCH  # every sequence of a batch in one forward
    assert speculated > RUNS // 2 and rejections > RUNS // 10  # drafts verified, residual path taken
    return counts


@contextlib.contextmanager
def packing(*models: CausalLM) -> Iterator[None]:
    """Pack these float64 models' steps (their rows agree to ~1e-15 however many share a
    forward, far below anything a distribution test can see)."""
    before = [model.row_exact for model in models]
    for model in models:
        model.row_exact = True
    try:
        yield
    finally:
        for model, was in zip(models, before, strict=True):
            model.row_exact = was


def pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    observed, expected = counts.reshape(-1), exact.reshape(-1) / exact.sum() * counts.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    keep = expected > 0
    return float(scipy.stats.power_divergence(observed[keep], expected[keep], lambda_="log-likelihood").pvalue)


@pytest.mark.slow
def test_engine_sampling_with_a_model_drafter_matches_the_target() -> None:
    assert pvalue(sampled_second_and_third_token(), exact_second_and_third_token()) > 0.001


@pytest.mark.slow
def test_engine_level_check_catches_a_planted_residual_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "_residual_distribution", lambda p, q: p)
    assert pvalue(sampled_second_and_third_token(), exact_second_and_third_token()) < 1e-4


# -- the same check under a grammar that removes part of the support --------------------------

CHARS = "abcxyz"  # token i is CHARS[i]
ITEM_EBNF = 'root ::= item*\nitem ::= "a" [xy] | "b" [yz] | "c" [xz] | "x"'
FOLLOWERS = {"a": "xy", "b": "yz", "c": "xz"}  # what the grammar allows after an item's head


def allowed_after(output: list[int]) -> list[int]:
    """The grammar's allowed next tokens, written out independently of xgrammar."""
    text = "".join(CHARS[token] for token in output)
    pending_head = ""
    for char in text:
        pending_head = "" if pending_head else (char if char in FOLLOWERS else "")
    allowed = FOLLOWERS[pending_head] if pending_head else "abcx"
    return [CHARS.index(char) for char in allowed]


def exact_constrained_pairs() -> torch.Tensor:
    def probs(output: list[int]) -> torch.Tensor:
        logits = TARGET.forward(TARGET.new_kv(), [*PROMPT, *output])[-1].clone()
        forbidden = [token for token in range(VOCAB) if token not in allowed_after(output)]
        logits[forbidden] = float("-inf")
        return probs_from_logits(logits, PARAMS)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = probs([])
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        if first[t1] == 0:
            continue
        second = probs([t1])
        if second[t2] > 0:
            joint[t2] += first[t1] * second[t2] * probs([t1, t2])
    return joint


def sampled_constrained_pairs() -> torch.Tensor:
    return sampled_second_and_third_token(item_grammar())


@pytest.mark.slow
def test_constrained_engine_sampling_matches_the_masked_target() -> None:
    assert pvalue(sampled_constrained_pairs(), exact_constrained_pairs()) > 0.001


@pytest.mark.slow
def test_constrained_check_catches_an_unmasked_draft_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the mask on q, cutting the chain at an ungrammatical draft biases the output."""
    monkeypatch.setattr(GrammarState, "draft_processor", lambda self, prompt_len: lambda prefix, logits: logits)
    assert pvalue(sampled_constrained_pairs(), exact_constrained_pairs()) < 1e-4


# -- the same check with draft trees from prompt lookup ----------------------------------------

# Passages in which every token is followed by several others: lookup finds forks everywhere.
FORKS = [[first, (first + step) % VOCAB, (first + 2 * step) % VOCAB] for first in range(VOCAB) for step in (1, 2, 3)]


def sampled_with_trees(
    grammar: Grammar | None = None, allow_errors: bool = False
) -> tuple[torch.Tensor, int, int, int]:
    """(second, third) token counts over RUNS seeded requests drafting trees, BATCH per step;
    how many of them verified a tree, how many took a token off their chain, how many failed."""
    engine = Engine(TARGET, min_ngram=1, max_ngram=2, policy=PolicyConfig(tree_nodes=8))
    trees = branch_wins = 0

    def on_finish(stats: GenerationStats) -> None:
        nonlocal trees, branch_wins
        trees += stats.tree_cycles > 0
        branch_wins += stats.branch_accepted_tokens > 0

    with packing(TARGET):
        sources = FORKS if grammar is None else ITEM_FORKS
        request_for = partial(sampled_request, grammar=grammar, lookup_sources=sources)
        counts, errors = batched_pair_counts(engine, request_for, on_finish, allow_errors)
    return counts, trees, branch_wins, errors


@pytest.mark.slow
def test_engine_sampling_over_draft_trees_matches_the_target() -> None:
    counts, trees, branch_wins, _ = sampled_with_trees()
    assert trees > RUNS // 2 and branch_wins > RUNS // 10  # the siblings' rule was exercised
    assert pvalue(counts, exact_second_and_third_token()) > 0.001


@pytest.mark.slow
def test_engine_tree_check_catches_unrenormalised_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    def accept_with_p(p_child: torch.Tensor, tried_mass: torch.Tensor, row_mass: torch.Tensor) -> torch.Tensor:
        return p_child.clamp(0.0, 1.0)

    monkeypatch.setattr(tree, "_sibling_acceptance", accept_with_p)
    assert pvalue(sampled_with_trees()[0], exact_second_and_third_token()) < 1e-4


# Every pair of the grammar's items: after a head, lookup finds both of its followers.
ITEMS = ["ax", "ay", "by", "bz", "cx", "cz", "x"]
ITEM_FORKS = [[CHARS.index(char) for char in first + second] for first in ITEMS for second in ITEMS]


def item_grammar() -> Grammar:
    info = xgr.TokenizerInfo(list(CHARS), vocab_size=VOCAB, stop_token_ids=[])
    return GrammarCompiler(info).ebnf(ITEM_EBNF)


@pytest.mark.slow
def test_constrained_sampling_over_draft_trees_matches_the_masked_target() -> None:
    counts, trees, branch_wins, _ = sampled_with_trees(item_grammar())
    assert trees > RUNS // 5 and branch_wins > RUNS // 50  # branches survived the grammar and won
    assert pvalue(counts, exact_constrained_pairs()) > 0.001


@pytest.mark.slow
def test_constrained_tree_check_catches_branches_masked_by_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: every branch node gets its row masked as if it followed the chain (one
    matcher for the whole tree). The run must fail loudly or sample the wrong law."""

    def chain_masks(self: GrammarState, tokens: list[int], parents: list[int]) -> tuple[list[int], torch.Tensor]:
        length = next((node for node, parent in enumerate(parents) if parent != node - 1), len(parents))
        valid, chain_rows = self.advance_chain(tokens[:length])
        self._matcher.rollback(valid)
        rows = [chain_rows[min(node_depths(parents)[node] + 1, valid)] for node in range(len(tokens))]
        return list(range(len(tokens))), torch.stack([chain_rows[0], *rows])

    monkeypatch.setattr(GrammarState, "advance_tree", chain_masks)
    counts, _, _, errors = sampled_with_trees(item_grammar(), allow_errors=True)
    assert errors > 0 or pvalue(counts, exact_constrained_pairs()) < 1e-4
