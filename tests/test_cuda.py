"""The engine, acceptance and grammar masks on CUDA (skipped without a GPU).

Every tensor the decoding code creates must live on the model's device: greedy
speculation on a CUDA model equals plain greedy, a seeded sampled run draws the same
tokens as on the CPU (draws run on the request's CPU generator), and a grammar's CPU
bitmask masks CUDA logits.
"""

from __future__ import annotations

import pytest
import torch

from specrag.decoding.acceptance import speculative_accept
from specrag.decoding.engine import Engine
from specrag.decoding.grammar import mask_logits, pack_allowed
from specrag.decoding.model import CausalLM
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import SamplingParams
from tests.conftest import tiny_causal_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


def on_cuda(lm: CausalLM) -> CausalLM:
    return CausalLM(lm.model.to("cuda"), row_exact=False)


def run(target: CausalLM, request: GenerationRequest) -> list[int]:
    return [token for event in Engine(target, debug=True).generate(request) for token in event.token_ids]


def test_greedy_speculation_on_cuda_equals_plain_greedy() -> None:
    target = on_cuda(tiny_causal_lm(48, seed=0))
    prompt = [(7 * i + 3) % 48 for i in range(40)]
    for speculation in ("on", "auto"):
        request = GenerationRequest(
            prompt, max_tokens=24, stop_token_ids=[], speculation=speculation, lookup_sources=[prompt[::-1]]
        )
        plain = GenerationRequest(prompt, max_tokens=24, stop_token_ids=[], speculation="off")
        assert run(target, request) == run(target, plain)


def test_seeded_sampling_on_cuda_draws_what_the_cpu_draws() -> None:
    prompt = [(5 * i + 1) % 48 for i in range(30)]

    def sampled(target: CausalLM) -> list[int]:
        request = GenerationRequest(
            prompt, max_tokens=16, stop_token_ids=[], speculation="on", sampling=SamplingParams(temperature=0.9, seed=5)
        )
        return run(target, request)

    assert sampled(on_cuda(tiny_causal_lm(48, seed=2))) == sampled(tiny_causal_lm(48, seed=2))


def test_acceptance_and_grammar_masks_work_on_cuda_tensors() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(4, 10, generator=generator), -1).cuda()
    draft = torch.softmax(torch.randn(3, 10, generator=generator), -1).cuda()
    tokens = torch.tensor([1, 2, 3], device="cuda")
    accepted, committed = speculative_accept(tokens, draft, target, torch.Generator().manual_seed(1))
    assert committed.device.type == "cuda" and len(committed) == accepted + 1
    allowed = torch.rand(2, 70, generator=generator) > 0.5
    logits = torch.randn(2, 70, generator=generator)
    masked = mask_logits(logits.cuda(), pack_allowed(allowed))
    assert masked.device.type == "cuda"
    assert torch.equal(masked.cpu(), mask_logits(logits, pack_allowed(allowed)))


def mixed_requests(offset: int, lengths: list[int], modes: list[str], max_tokens: int) -> list[GenerationRequest]:
    """Greedy requests of several lengths, each drafting (or not) over its reversed prompt."""
    prompts = [[(length * i + offset) % 48 for i in range(length)] for length in lengths]
    return [
        GenerationRequest(
            prompt, max_tokens=max_tokens, stop_token_ids=[], speculation=mode, lookup_sources=[prompt[::-1]]
        )
        for prompt, mode in zip(prompts, modes, strict=True)
    ]


def assert_served_together_as_plain_alone(target: CausalLM, requests: list[GenerationRequest]) -> None:
    """One engine serves every request at once; each output must be its plain greedy run alone."""
    engine = Engine(target, debug=True)
    ids = [engine.add(request) for request in requests]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id].extend(event.token_ids)
    for seq_id, request in zip(ids, requests, strict=True):
        plain = GenerationRequest(
            request.prompt_tokens, max_tokens=request.max_tokens, stop_token_ids=[], speculation="off"
        )
        assert outputs[seq_id] == run(target, plain)


def test_one_engine_serving_several_sequences_on_cuda_gives_each_its_run_alone() -> None:
    target = on_cuda(tiny_causal_lm(48, seed=3))
    assert_served_together_as_plain_alone(target, mixed_requests(1, [17, 22, 27, 37], ["on", "off", "auto", "on"], 20))


def test_bf16_steps_on_cuda_are_packed_where_the_probes_pass_and_change_no_output(packed_sizes: list[int]) -> None:
    """The default dtype on CUDA: if the probes find packed steps bit-exact, several
    sequences share each forward and every output is still its plain greedy run alone."""
    target = CausalLM(tiny_causal_lm(48, seed=4).model.to("cuda", torch.bfloat16))
    if not target.batch_invariant:
        pytest.skip("the packed-step probes fail on this GPU: one forward per sequence")
    requests = mixed_requests(2, [17, 24, 31, 38, 52], ["on", "off", "auto", "on", "off"], 16)
    assert_served_together_as_plain_alone(target, requests)
    assert max(packed_sizes) >= 4
