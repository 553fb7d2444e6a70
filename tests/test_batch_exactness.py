"""Batching changes no text: in float32, each sequence's output equals its run alone.

The real smollm2 pack in float32, where the probes of ``decoding/batch_invariance.py``
(linears through oneDNN) make a packed step bit-identical to the sequences' own forwards.
One engine runs a mix: a two-chunk prefill beside decoding sequences, plain and verify
cycles, two grammar-constrained ones (their masks share the step's one bitmask), seeded
sampling with speculation off and on, sequences joining mid-flight, one finishing early
and one cancelled. Every output must equal that request's run alone; greedy ones also
their plain greedy run alone (speculation off; in float32 a verify row may differ from a
one-token step by ~1e-6, the near-tie rule, which no prompt here comes near).
Where the probe fails, the engine runs one forward per sequence and the same holds.
"""

from __future__ import annotations

import dataclasses

from specrag.decoding.engine import Engine
from specrag.decoding.model import CausalLM
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["name", "year"],
}
OTHER_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 3}  # shares no step mask row with SCHEMA


def _requests(lm: CausalLM) -> list[GenerationRequest]:
    def tokens(text: str) -> list[int]:
        return lm.tokenizer(text)["input_ids"]

    passage = tokens(
        "The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is 330 metres tall "
        "and was the tallest man-made structure in the world until 1930."
    )
    question = tokens(" Question: when was the Eiffel Tower completed and how tall is it? Answer:")
    long_prompt = (passage * 4 + question)[:300]  # two prefill chunks (256 + 44)
    return [
        GenerationRequest(passage + question, max_tokens=24, speculation="on", lookup_sources=[passage]),
        GenerationRequest(tokens("def fibonacci(n):"), max_tokens=24, speculation="off"),
        GenerationRequest(long_prompt, max_tokens=16, speculation="auto", lookup_sources=[passage]),
        GenerationRequest(
            tokens("A JSON object about the Eiffel Tower:"),
            max_tokens=24,
            speculation="on",
            grammar=lm.grammar_compiler.json_schema(SCHEMA),
        ),
        GenerationRequest(
            tokens("The first prime numbers, as a JSON list:"),
            max_tokens=16,
            speculation="off",
            grammar=lm.grammar_compiler.json_schema(OTHER_SCHEMA),
        ),
        GenerationRequest(
            tokens("Once upon a time"),
            max_tokens=20,
            speculation="off",
            sampling=SamplingParams(temperature=0.8, seed=7),
        ),
        GenerationRequest(
            passage + tokens(" In short,"),
            max_tokens=20,
            speculation="on",
            lookup_sources=[passage],
            sampling=SamplingParams(temperature=0.7, seed=3),
        ),
        GenerationRequest(tokens("The capital of France is"), max_tokens=4, speculation="on"),  # finishes early
    ]


def _alone(lm: CausalLM, request: GenerationRequest) -> list[int]:
    engine = Engine(lm, debug=True)
    return [token for event in engine.generate(request) for token in event.token_ids]


def test_float32_outputs_do_not_depend_on_the_batch(smollm2: CausalLM, packed_sizes: list[int]) -> None:
    requests = _requests(smollm2)
    cancelled = GenerationRequest(smollm2.tokenizer("Count: 1, 2, 3,")["input_ids"], max_tokens=40, speculation="on")
    engine = Engine(smollm2, debug=True)
    outputs: dict[int, list[int]] = {}
    ids = [engine.add(request) for request in requests[:5]]
    cancelled_id = engine.add(cancelled)
    joining = list(requests[5:])
    steps = 0
    while engine.has_unfinished():
        for event in engine.step():
            outputs.setdefault(event.seq_id, []).extend(event.token_ids)
        steps += 1
        if steps in (2, 5) and joining:  # sequences join mid-flight
            ids.append(engine.add(joining.pop(0)))
        if steps == 4:
            engine.cancel(cancelled_id)
        if steps == 6 and joining:
            ids.append(engine.add(joining.pop(0)))
    assert not joining
    if smollm2.batch_invariant:  # packed, several sequences per forward
        assert max(packed_sizes) >= 4
    else:
        assert not packed_sizes
    for seq_id, request in zip(ids, requests, strict=True):
        assert outputs[seq_id] == _alone(smollm2, request), f"request {ids.index(seq_id)} changed in the batch"
        if request.sampling.temperature == 0:  # greedy: speculation changes nothing either
            plain = dataclasses.replace(request, speculation="off")
            assert outputs[seq_id] == _alone(smollm2, plain)
