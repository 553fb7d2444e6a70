"""Grammar-constrained speculation on tiny models over a character vocabulary (fast, exact).

The vocabulary is 47 single characters plus an empty-string stop token, so xgrammar sees
a real (raw) tokenizer and the tiny float64 models of conftest can be constrained.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar as xgr

from specrag.decoding import policy as policies
from specrag.decoding.engine import Engine
from specrag.decoding.grammar import GrammarState, allowed_tokens, mask_logits, pack_allowed
from specrag.decoding.grammar_compile import GrammarCompiler, UnsupportedSchemaError
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import SamplingParams
from tests.conftest import tiny_causal_lm

VOCAB = [*'{}[]":, ', *"0123456789", *"abcdefghijklmnopqrstuvwxyz", ".", "-", "\n", ""]
EOS = len(VOCAB) - 1

SCHEMAS = {
    "int_and_enum": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["xy", "zz"]}},
        "required": ["a", "b"],
    },
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    "nested": {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
            "tag": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        },
        "required": ["point", "tag"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"k": {"type": "boolean"}, "v": {"type": "string", "maxLength": 3}},
        "required": ["k"],
    },
}
TOOLS = [
    ("search", {"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}}, "required": ["q"]}),
    ("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
]


def encode(text: str) -> list[int]:
    return [VOCAB.index(char) for char in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[token] for token in ids)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS]))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_causal_lm(len(VOCAB), seed=0), tiny_causal_lm(len(VOCAB), seed=1), debug=True)


def generate(engine: Engine, prompt: list[int], **kwargs: object) -> tuple[list[int], object]:
    tokens: list[int] = []
    stats = None
    for event in engine.generate(GenerationRequest(prompt, stop_token_ids=[EOS], **kwargs)):
        tokens += event.token_ids
        stats = event.stats or stats
    return tokens, stats


def fresh_state(compiler: GrammarCompiler, schema: dict, tokens: list[int]) -> GrammarState:
    state = GrammarState(compiler.json_schema(schema), [EOS], len(VOCAB))
    for token in tokens:
        state.accept(token)
    return state


# -- bitmask helpers ------------------------------------------------------------------------


def test_pack_and_unpack_are_inverse() -> None:
    allowed = torch.rand(3, 77, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(allowed_tokens(pack_allowed(allowed), 77), allowed)


def test_mask_logits_forbids_exactly_the_masked_tokens() -> None:
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, [3, 31, 32]] = True
    masked = mask_logits(torch.zeros(40, dtype=torch.float64), pack_allowed(allowed)[0])
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [3, 31, 32]


# -- matcher rollback -----------------------------------------------------------------------


def _random_chain(compiler: GrammarCompiler, schema: dict, committed: list[int], rng: random.Random) -> list[int]:
    """Mostly grammatical candidates continuing ``committed``, sometimes with a wrong one planted."""
    scratch = fresh_state(compiler, schema, committed)
    chain: list[int] = []
    for _ in range(rng.randint(1, 6)):
        if scratch.is_terminated():
            break
        allowed = allowed_tokens(scratch.next_bitmask(), len(VOCAB))[0].nonzero().flatten().tolist()
        token = rng.choice(allowed) if rng.random() > 0.15 else rng.randrange(len(VOCAB))
        chain.append(token)
        if token not in allowed:
            break
        scratch.accept(token)
    return chain


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["int_and_enum", "nested", "bounded_array"])
def test_matcher_after_random_accept_reject_equals_a_fresh_one(compiler: GrammarCompiler, name: str, seed: int) -> None:
    schema, rng = SCHEMAS[name], random.Random(seed)
    state = GrammarState(compiler.json_schema(schema), [EOS], len(VOCAB))
    committed: list[int] = []
    for _ in range(60):
        if state.is_terminated():
            break
        chain = _random_chain(compiler, schema, committed, rng)
        valid_len, bitmask = state.advance_chain(chain)
        assert valid_len <= len(chain) and bitmask.shape[0] == valid_len + 1
        accepted_len = rng.randint(0, valid_len)
        row = allowed_tokens(bitmask[accepted_len : accepted_len + 1], len(VOCAB))[0]
        final = rng.choice(row.nonzero().flatten().tolist())
        cycle = [*chain[:accepted_len], final]
        state.settle(valid_len, cycle)
        if EOS in cycle:  # nothing after a stop token is ever committed
            cycle = cycle[: cycle.index(EOS) + 1]
        committed += cycle
        fresh = fresh_state(compiler, schema, committed)
        assert state.committed_len == len(committed)
        assert state.is_completed() == fresh.is_completed()
        assert state.is_terminated() == fresh.is_terminated()
        if not state.is_terminated():
            assert torch.equal(state.next_bitmask(), fresh.next_bitmask())
    assert committed, "the walk never committed anything"


def test_a_chain_is_cut_at_its_first_rejected_candidate(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.json_schema(SCHEMAS["int_and_enum"]), [EOS], len(VOCAB))
    chain = encode('{"qa')  # "q" is not a key of the schema; "a" after it would be
    valid_len, bitmask = state.advance_chain(chain)
    assert valid_len == 2 and bitmask.shape[0] == 3  # '{' and '"', then the mask for "q"'s slot
    assert not allowed_tokens(bitmask[2:], len(VOCAB))[0, VOCAB.index("q")]
    state.settle(valid_len, encode('{"a'))
    fresh = fresh_state(compiler, SCHEMAS["int_and_enum"], encode('{"a'))
    assert torch.equal(state.next_bitmask(), fresh.next_bitmask())


# -- the engine under a grammar ------------------------------------------------------------

PROMPT = encode('{"a": 12, "b": "xy"} {"point": {"x": 1, "y": 2}, "tag": "ab"} [1, 2] {"k": true')


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize(("speculation", "drafter"), [("on", "lookup"), ("on", "model"), ("auto", "both")])
def test_constrained_speculative_greedy_equals_constrained_plain(
    engine: Engine, compiler: GrammarCompiler, name: str, speculation: str, drafter: str
) -> None:
    grammar = compiler.json_schema(SCHEMAS[name])
    plain, plain_stats = generate(engine, PROMPT, max_tokens=48, grammar=grammar, speculation="off")
    fast, stats = generate(engine, PROMPT, max_tokens=48, grammar=grammar, speculation=speculation, drafter=drafter)
    assert fast == plain
    assert stats.finish_reason == plain_stats.finish_reason
    fresh_state(compiler, SCHEMAS[name], fast)  # every committed token is grammatical
    if stats.finish_reason == "stop":
        jsonschema.validate(json.loads(decode(fast[:-1])), SCHEMAS[name])


def test_forced_tokens_are_free_drafts_that_save_target_calls(engine: Engine, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema(SCHEMAS["nested"])
    plain, plain_stats = generate(engine, PROMPT[:1], max_tokens=48, grammar=grammar, speculation="off")
    fast, stats = generate(engine, PROMPT[:1], max_tokens=48, grammar=grammar, speculation="on", drafter="lookup")
    assert fast == plain
    assert stats.accepted_by_source["grammar"] > 0
    assert stats.target_calls < plain_stats.target_calls
    assert stats.grammar_s > 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("speculation", ["off", "on"])
def test_sampled_constrained_outputs_are_grammatical(
    engine: Engine, compiler: GrammarCompiler, speculation: str, seed: int
) -> None:
    for name, schema in SCHEMAS.items():
        sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        tokens, stats = generate(
            engine,
            PROMPT,
            max_tokens=64,
            grammar=compiler.json_schema(schema),
            sampling=sampling,
            speculation=speculation,
            drafter="both",
        )
        fresh_state(compiler, schema, tokens)
        if stats.finish_reason == "stop":
            jsonschema.validate(json.loads(decode(tokens[:-1])), schema), name


@pytest.mark.parametrize("allow_text", [False, True])
def test_tool_call_grammar_admits_only_known_tools_with_valid_arguments(
    compiler: GrammarCompiler, allow_text: bool
) -> None:
    grammar = compiler.tool_calls(TOOLS, allow_text=allow_text)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar.compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts('{"name": "search", "arguments": {"q": "ab"}}')
    assert accepts('{"name": "add", "arguments": {"a": 1}}')
    assert not accepts('{"name": "delete", "arguments": {}}')
    assert not accepts('{"name": "add", "arguments": {"a": "x"}}')
    assert not accepts('{"name": "search", "arguments": {"q": "abcdef"}}')
    assert accepts("the answer is 4.") == allow_text


def test_stop_sequence_inside_a_constrained_span_finishes_with_length(
    engine: Engine, compiler: GrammarCompiler
) -> None:
    grammar = compiler.json_schema(SCHEMAS["int_and_enum"])
    plain, _ = generate(engine, PROMPT, max_tokens=48, grammar=grammar, speculation="off")
    stop = plain[2:4]  # a span in the middle of the document
    tokens, stats = generate(engine, PROMPT, max_tokens=48, grammar=grammar, stop_sequences=[stop], speculation="on")
    assert tokens == plain[:4] and stats.finish_reason == "length"
    _, short = generate(engine, PROMPT, max_tokens=3, grammar=grammar, speculation="on")
    assert short.finish_reason == "length"


def test_a_grammar_rejected_draft_falls_back_to_a_plain_step(engine: Engine, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_schema({"type": "array", "items": {"type": "integer"}})
    # the prompt's n-grams continue "[1" with ", b" but the grammar wants digits or a comma
    prompt = encode("[1ab [1ab [1ab [1")
    plain, _ = generate(engine, prompt, max_tokens=24, grammar=grammar, speculation="off")
    fast, stats = generate(engine, prompt, max_tokens=24, grammar=grammar, speculation="on", drafter="lookup")
    assert fast == plain
    assert set(stats.speculation_off_reasons) <= {policies.GRAMMAR_REJECTED, policies.NO_PROPOSAL}


# -- compilation -----------------------------------------------------------------------------


def test_grammars_are_compiled_once_per_canonical_schema(compiler: GrammarCompiler) -> None:
    first = compiler.json_schema({"type": "object", "properties": {"p": {"type": "integer"}}, "required": ["p"]})
    before = compiler.cached
    again = compiler.json_schema('{"required": ["p"], "properties": {"p": {"type": "integer"}}, "type": "object"}')
    assert again is first and compiler.cached == before


@pytest.mark.parametrize(
    ("schema", "feature", "path"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}, "uniqueItems", "#"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not", "#/properties/a"),
        ({"if": {"required": ["a"]}, "then": {"type": "object"}, "else": {"type": "string"}}, "if", "#"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "#"),
        ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "allOf", "#/allOf/1"),
        ({"type": "string", "pattern": r"^(a)\1$"}, "pattern", "#"),
        ({"type": "string", "pattern": r"^(?1)a$", "maxLength": 3}, "pattern", "#"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#"),
        ({"type": "teapot"}, "schema", "#"),
    ],
)
def test_unsupported_schema_features_are_named(
    compiler: GrammarCompiler, schema: dict, feature: str, path: str
) -> None:
    with pytest.raises(UnsupportedSchemaError, match=feature) as raised:
        compiler.json_schema(schema)
    assert raised.value.feature == feature and raised.value.path == path


def test_a_property_named_like_a_keyword_is_fine(compiler: GrammarCompiler) -> None:
    compiler.json_schema({"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "string"}}})


def test_json_object_mode_goes_through_the_same_path(engine: Engine, compiler: GrammarCompiler) -> None:
    grammar = compiler.json_object()
    assert compiler.json_object() is grammar
    plain, _ = generate(engine, PROMPT, max_tokens=40, grammar=grammar, speculation="off")
    fast, stats = generate(engine, PROMPT, max_tokens=40, grammar=grammar, speculation="on", drafter="both")
    assert fast == plain
    matcher = xgr.GrammarMatcher(grammar.compiled)
    assert all(matcher.accept_token(token) for token in fast)
    probe = xgr.GrammarMatcher(grammar.compiled)
    assert probe.accept_string('{"any": [1, {"key": null}]}') and probe.is_completed()
    assert not xgr.GrammarMatcher(grammar.compiled).accept_string("[1]")  # an object, not any JSON value
    if stats.finish_reason == "stop":
        assert isinstance(json.loads(decode(fast[:-1])), dict)


@pytest.mark.parametrize(
    "schema", [{"type": "object", "properties": 5}, {"anyOf": {"type": "string"}}, {"items": {"properties": []}}]
)
def test_malformed_schemas_are_refused_with_the_keyword_named(compiler: GrammarCompiler, schema: dict) -> None:
    with pytest.raises(UnsupportedSchemaError) as caught:
        compiler.json_schema(schema)
    assert caught.value.feature in {"properties", "anyOf"}


def test_the_grammar_cache_is_bounded_and_keeps_the_recently_used(compiler: GrammarCompiler) -> None:
    small = GrammarCompiler(compiler.tokenizer_info, compiler.encode, max_cached=3)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5)]
    first = small.json_schema(schemas[0])
    for schema in schemas[1:3]:
        small.json_schema(schema)
    assert small.json_schema(schemas[0]) is first  # a hit refreshes it
    for schema in schemas[3:]:
        small.json_schema(schema)
    assert small.cached == 3 and small.json_schema(schemas[0]) is first
