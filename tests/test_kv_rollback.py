"""After any accept/reject sequence, cached next-token logits equal a fresh forward."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding import Engine, GenerationRequest, SamplingParams
from specrag.decoding.drafters import ModelDrafter
from specrag.decoding.model import CausalLM
from specrag.decoding.sampling import SamplingParams as Params
from tests.conftest import tiny_causal_lm

VOCAB = 40
TARGET = tiny_causal_lm(VOCAB, seed=3)
DRAFT = tiny_causal_lm(VOCAB, seed=4, hidden_size=16, layers=1)


def fresh_last_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    return model.forward(model.new_kv(), tokens)[-1]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    cycles=st.lists(
        st.tuples(
            st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=6), st.integers(0, 6), st.integers(0, VOCAB - 1)
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_target_cache_after_any_accept_reject_pattern(
    prompt: list[int], cycles: list[tuple[list[int], int, int]]
) -> None:
    kv = TARGET.new_kv()
    committed = list(prompt)
    if len(committed) > 1:
        TARGET.prefill(kv, committed[:-1])  # the cache holds all but the pending token
    for candidates, accepted_hint, correction in cycles:
        before = len(kv)
        TARGET.forward(kv, [committed[-1], *candidates])
        accepted_len = min(accepted_hint, len(candidates))
        kv.crop(before + 1 + accepted_len)
        committed += [*candidates[:accepted_len], correction]
        assert kv.token_ids == committed[:-1] and kv.cached_length() == len(committed) - 1
    cached = TARGET.forward(kv, committed[-1:])[-1]
    torch.testing.assert_close(cached, fresh_last_logits(TARGET, committed), rtol=1e-9, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    cycles=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, VOCAB - 1)), min_size=1, max_size=6),
)
def test_draft_cache_after_any_accept_reject_pattern(prompt: list[int], cycles: list[tuple[int, int, int]]) -> None:
    drafter = ModelDrafter(DRAFT, Params())
    context = list(prompt)
    for gamma, accepted_hint, correction in cycles:
        draft = drafter.propose(context, gamma)
        accepted_len = min(accepted_hint, len(draft.tokens))
        committed = [*draft.tokens[:accepted_len], correction]
        drafter.on_commit(committed, accepted_len)
        context += committed
        assert drafter.cache_matches(context)
    # The drafter ingests what it lacks (the correction or bonus token) before drafting:
    # its first proposal must be the argmax of a fresh forward over the whole context.
    next_draft = drafter.propose(context, 1)
    assert next_draft.tokens == [int(fresh_last_logits(DRAFT, context).argmax())]


def test_engine_caches_match_fresh_forwards_after_every_sampled_cycle() -> None:
    engine = Engine(TARGET, DRAFT, default_drafter="model", debug=True)
    request = GenerationRequest(
        [5, 6, 7, 8],
        max_tokens=40,
        speculation="on",
        stop_token_ids=[],
        num_speculative_tokens=5,
        sampling=SamplingParams(temperature=1.0, seed=9),
    )
    seq_id = engine.add(request)
    while engine.has_unfinished():
        event = engine.step()[0]
        if event.finished:
            break
        seq = engine._active[seq_id]  # white-box: the invariant is about the engine's own caches
        cached = TARGET.forward(seq.kv, seq.tokens[-1:])[-1]
        seq.kv.crop(len(seq.tokens) - 1)
        torch.testing.assert_close(cached, fresh_last_logits(TARGET, seq.tokens), rtol=1e-9, atol=1e-9)
        assert isinstance(seq.drafters[0], ModelDrafter) and seq.drafters[0].cache_matches(seq.tokens)
    assert seq.stats.accepted_len_hist[0] > 0  # some cycles really rejected everything
