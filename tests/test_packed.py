"""One forward over several sequences' chunks (decoding/packed.py) gives each chunk the
logits, and leaves each cache in the state, that forwarding it alone would."""

from __future__ import annotations

import pytest
import torch

from specrag.decoding import packed
from specrag.decoding.model import CausalLM
from specrag.decoding.packed import Chunk, packed_forward
from tests.conftest import tiny_causal_lm

PROMPTS = [[3, 17, 5, 22, 9, 31, 4], [8, 1], [40, 2, 2, 7, 19, 11, 30, 6, 5, 12, 44]]
CHUNKS = [[13], [20, 21, 22, 23, 24], [7, 7, 1]]  # a plain step, a verify chain, a short append


def prefilled(lm: CausalLM) -> list:
    caches = []
    for prompt in PROMPTS:
        kv = lm.new_kv()
        lm.forward(kv, prompt)
        caches.append(kv)
    return caches


@pytest.mark.parametrize(
    ("dtype", "row_exact"), [(torch.float64, False), (torch.float32, True), (torch.bfloat16, True)]
)
def test_each_chunk_gets_the_logits_of_its_own_forward(dtype: torch.dtype, row_exact: bool) -> None:
    lm = CausalLM(tiny_causal_lm(48, seed=5, dtype=dtype).model, row_exact=row_exact)
    alone, packed = prefilled(lm), prefilled(lm)
    expected = [lm.forward(kv, chunk) for kv, chunk in zip(alone, CHUNKS, strict=True)]
    got = packed_forward(lm, [Chunk(kv, chunk) for kv, chunk in zip(packed, CHUNKS, strict=True)])
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 0.05}[dtype]  # row-count rounding
    for want, have in zip(expected, got, strict=True):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=tolerance, rtol=0)
    # the caches hold the same tokens and keep working: a next step alone agrees too
    for before, after in zip(alone, packed, strict=True):
        assert before.token_ids == after.token_ids and after.cached_length() == len(after)
        torch.testing.assert_close(lm.forward(after, [5]), lm.forward(before, [5]), atol=tolerance, rtol=0)


def test_a_rolled_back_sequence_is_packed_from_its_committed_tokens() -> None:
    lm = CausalLM(tiny_causal_lm(48, seed=5).model)
    alone, packed = prefilled(lm), prefilled(lm)
    packed_forward(lm, [Chunk(kv, chunk) for kv, chunk in zip(packed, CHUNKS, strict=True)])
    packed[1].crop(len(PROMPTS[1]) + 2)  # two of five drafts accepted
    lm.forward(alone[1], CHUNKS[1][:2])
    lm.forward(alone[0], CHUNKS[0])
    got = packed_forward(lm, [Chunk(packed[1], [9, 9]), Chunk(packed[0], [1])])
    want = [lm.forward(alone[1], [9, 9]), lm.forward(alone[0], [1])]
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, atol=1e-12, rtol=0)


def test_sequences_never_see_each_other() -> None:
    lm = CausalLM(tiny_causal_lm(48, seed=5).model)
    first, other = prefilled(lm)[:2]
    reference = packed_forward(lm, [Chunk(first, [13, 14])])[0]
    first.crop(len(PROMPTS[0]))
    beside = packed_forward(lm, [Chunk(other, [33, 34, 35]), Chunk(first, [13, 14])])[1]
    torch.testing.assert_close(beside, reference, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="one chunk"):
        packed_forward(lm, [Chunk(first, [1]), Chunk(first, [2])])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_where_linears_are_row_exact_a_packed_step_is_bit_for_bit_the_sequences_alone(dtype: str) -> None:
    """smollm2 on a CPU whose GEMM is row-invariant in ``dtype`` (the probe of
    decoding/batch_invariance.py; float32 through oneDNN): batching the step changes no bit
    of any logit, so greedy output cannot depend on the batch. Where the probe fails,
    row-exact is off."""
    from specrag.decoding.model import load_model

    lm = load_model("smollm2-135m", dtype=dtype, progress=False)
    if not lm.batch_invariant:
        pytest.skip(f"{dtype} linears are not row-exact on this CPU (decoding/batch_invariance.py)")
    assert lm.row_exact == (dtype == "bfloat16")  # float32 keeps the fast attention (near-tie rule)
    alone, packed = prefilled(lm), prefilled(lm)
    expected = [lm.forward(kv, chunk) for kv, chunk in zip(alone, CHUNKS, strict=True)]
    got = packed_forward(lm, [Chunk(kv, chunk) for kv, chunk in zip(packed, CHUNKS, strict=True)])
    assert all(torch.equal(have, want) for have, want in zip(got, expected, strict=True))


def test_the_packed_benchmark_prints_one_row_per_batch_and_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    from specrag.evals.bench.packed import BATCH_SIZES, CHUNK_TOKENS, main

    assert main(["--model", "smollm2-135m", "--dtype", "float32", "--context", "8", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| smollm2-135m |")]
    assert len(rows) == len(BATCH_SIZES) * len(CHUNK_TOKENS) and all(row.endswith("x |") for row in rows)


def test_an_engine_step_over_many_sequences_is_one_packed_forward_and_changes_no_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Packed where packing is exact (row-exact mode, here forced on a float64 model whose
    rows agree to rounding): greedy and seeded sampled, speculative and plain, every
    output equals the sequence's run alone."""
    from specrag.decoding import step_driver
    from specrag.decoding.engine import Engine
    from specrag.decoding.request import GenerationRequest
    from specrag.decoding.sampling import SamplingParams

    target = tiny_causal_lm(48, seed=0)
    target.row_exact = True
    calls: list[int] = []
    real = step_driver.packed_forward

    def counted(lm: CausalLM, chunks: list[Chunk]) -> list[torch.Tensor]:
        calls.append(len(chunks))
        return real(lm, chunks)

    monkeypatch.setattr(step_driver, "packed_forward", counted)
    monkeypatch.setattr(packed, "packed_forward", counted)  # a prefill chunk alone: CausalLM.forward_prompt
    prompts = [[(7 * seed + 3 * i) % 48 for i in range(10 + 3 * seed)] * 2 for seed in range(4)]
    requests = [
        GenerationRequest(
            prompt,
            max_tokens=12,
            stop_token_ids=[],
            speculation=["on", "off"][index % 2],
            lookup_sources=[prompt[::-1]],
            sampling=SamplingParams(temperature=0.8, seed=11) if index == 3 else SamplingParams(),
        )
        for index, prompt in enumerate(prompts)
    ]
    engine = Engine(target, debug=True, min_ngram=1)
    ids = [engine.add(request) for request in requests]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
    assert calls and max(calls) == len(requests)  # one forward for all four, while all ran
    for seq_id, request in zip(ids, requests, strict=True):
        alone = Engine(target, debug=True, min_ngram=1)
        assert outputs[seq_id] == [token for event in alone.generate(request) for token in event.token_ids]
    engine = Engine(target, debug=True, pack=False)
    calls.clear()
    for request in requests:
        engine.add(request)
    while engine.has_unfinished():
        engine.step()
    assert calls and max(calls) == 1  # pack=False: one forward per sequence (a prefill chunk alone too)


def test_model_drafters_draft_in_lockstep_and_change_no_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences whose draft model won share each draft forward (one packed draft call per
    draft position for all of them), and every output equals the sequence's run alone."""
    from specrag.decoding import step_driver
    from specrag.decoding.engine import Engine
    from specrag.decoding.request import GenerationRequest
    from specrag.decoding.sampling import SamplingParams

    target, draft = tiny_causal_lm(48, seed=0), tiny_causal_lm(48, seed=0)  # the same weights: drafts accepted
    target.row_exact = draft.row_exact = True  # float64: rows agree to rounding, so packing is exact
    draft_calls: list[int] = []
    real = step_driver.packed_forward

    def counted(lm: CausalLM, chunks: list[Chunk]) -> list[torch.Tensor]:
        if lm is draft:
            draft_calls.append(len(chunks))
        return real(lm, chunks)

    monkeypatch.setattr(step_driver, "packed_forward", counted)
    prompts = [[(5 * seed + 2 * i) % 48 for i in range(9 + seed)] for seed in range(3)]
    requests = [
        GenerationRequest(
            prompt,
            max_tokens=10,
            stop_token_ids=[],
            speculation="on",
            drafter="model",
            num_speculative_tokens=3,
            sampling=SamplingParams(temperature=0.7, seed=2) if index == 1 else SamplingParams(),
        )
        for index, prompt in enumerate(prompts)
    ]
    engine = Engine(target, draft, debug=True)
    ids = [engine.add(request) for request in requests]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    accepted: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
            if event.finished:
                accepted[event.seq_id] = event.stats.acceptance_by_position
    assert draft_calls and max(draft_calls) == len(requests)  # one draft forward for all three
    for seq_id, request in zip(ids, requests, strict=True):
        events = list(Engine(target, draft, debug=True).generate(request))
        assert outputs[seq_id] == [token for event in events for token in event.token_ids]
        assert accepted[seq_id] == events[-1].stats.acceptance_by_position  # the same drafts, too
    assert sum(sum(counts) for counts in accepted.values()) > 10
