"""A word the grammar cuts short pours its probability into its allowed part
(decoding/cut_words.py): the table of word prefixes, the transform of one row, and
constrained decoding with it, greedy speculation still equal to plain greedy."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import xgrammar as xgr

from specrag.decoding.cut_words import NO_PREFIX, pour_cut_words, word_prefix_table
from specrag.decoding.engine import Engine
from specrag.decoding.grammar import Grammar, GrammarState, allowed_tokens, mask_logits, pack_allowed
from specrag.decoding.grammar_compile import GrammarCompiler
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import probs_from_logits
from tests.conftest import tiny_causal_lm
from tests.test_engine_sampling import PARAMS, PROMPT, TARGET, pvalue, sampled_second_and_third_token

WORDS = [b"m", b"mi", b"mile", b"miles", b" m", b" miles", b"ile", b"iles", b'"', b'"}}', b"<tool_call>", b"km"]


def test_each_word_token_points_at_the_same_word_less_its_last_letter() -> None:
    table = word_prefix_table(WORDS).tolist()
    named = {WORDS[token]: (WORDS[prefix] if prefix != NO_PREFIX else None) for token, prefix in enumerate(table)}
    assert named[b"miles"] == b"mile" and named[b"mi"] == b"m" and named[b"iles"] == b"ile"
    assert named[b"mile"] is None and named[b"ile"] is None  # "mil" and "il" are no tokens here
    assert named[b" miles"] is None  # the same leading space, or nothing
    assert named[b"m"] is None and named[b"km"] is None
    assert named[b'"}}'] is None and named[b"<tool_call>"] is None  # structure is no word


def row(**logits: float) -> torch.Tensor:
    values = torch.full((1, len(WORDS)), float("-inf"), dtype=torch.float64)  # unlisted: impossible
    for text, value in logits.items():
        values[0, WORDS.index(text.encode())] = value
    return values


def mask(*allowed: str) -> torch.Tensor:
    flags = torch.zeros(1, len(WORDS), dtype=torch.bool)
    for text in allowed:
        flags[0, WORDS.index(text.encode())] = True
    return pack_allowed(flags)


def test_a_cut_word_gives_its_probability_to_its_allowed_part() -> None:
    table = word_prefix_table(WORDS)
    # after `"m`: the model wants "iles", the grammar allows "ile" or the closing `"}}`
    logits = row(iles=3.0, ile=0.0, **{'"}}': 1.0})
    bitmask = mask("ile", '"}}')
    masked_alone = mask_logits(logits, bitmask)
    assert WORDS[int(masked_alone.argmax())] == b'"}}'  # what masking alone chooses
    poured = mask_logits(pour_cut_words(logits, bitmask, table), bitmask)
    assert WORDS[int(poured.argmax())] == b"ile"
    probs = poured.softmax(-1)[0]
    full = logits.softmax(-1)[0]
    kept = full[WORDS.index(b"ile")] + full[WORDS.index(b"iles")] + full[WORDS.index(b'"}}')]
    assert float(probs[WORDS.index(b"ile")]) == pytest.approx(float((full[6] + full[7]) / kept), rel=1e-12)
    # tokens nothing flows to keep their exact value
    assert pour_cut_words(logits, bitmask, table)[0, WORDS.index(b'"}}')] == logits[0, WORDS.index(b'"}}')]


def test_a_word_cut_by_more_than_one_letter_gives_nothing() -> None:
    """Cut shorter, a prefix is mostly the start of another word ("break" into "b")."""
    table = word_prefix_table(WORDS)
    logits = row(miles=5.0, mile=-1.0, mi=-3.0, km=0.0)
    bitmask = mask("mi", "km")
    assert torch.equal(pour_cut_words(logits, bitmask, table), logits)
    assert WORDS[int(mask_logits(pour_cut_words(logits, mask("mile", "km"), table), mask("mile", "km")).argmax())] == (
        b"mile"
    )


def test_what_is_no_word_or_has_no_allowed_prefix_gives_nothing() -> None:
    table = word_prefix_table(WORDS)
    logits = row(**{"<tool_call>": 5.0, "iles": 4.0, "m": 0.0, "km": 1.0})
    bitmask = mask("m", "km")  # "<" is no word, and "iles" has no allowed prefix here
    assert torch.equal(pour_cut_words(logits, bitmask, table), logits)


# An enum value the model would spell longer than the grammar allows, on the character
# vocabulary of tests/test_grammar.py plus the word tokens below.
VOCAB = [*'{}[]":, ', *"0123456789", *"abcdefghijklmnopqrstuvwxyz", "mi", "mile", "miles", "\n", ""]
EOS = len(VOCAB) - 1
MILES = VOCAB.index("miles")


def favour_miles(prefix: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    boosted = logits.clone()
    boosted[..., MILES] += 30.0  # the model's intent: "miles", which the enum does not hold
    boosted[..., [VOCAB.index("m"), VOCAB.index('"')]] += 20.0  # its next best: "m", then closing
    return boosted


favour_miles.speculative_safe = True  # type: ignore[attr-defined]


def constrained(compiler: GrammarCompiler, speculation: str, passage: list[int], drafter: str = "lookup") -> list[int]:
    draft = tiny_causal_lm(len(VOCAB), seed=1) if drafter == "model" else None
    engine = Engine(tiny_causal_lm(len(VOCAB), seed=0), draft, debug=True, min_ngram=1)
    request = GenerationRequest(
        [VOCAB.index(char) for char in "unit: "],
        max_tokens=12,
        speculation=speculation,  # type: ignore[arg-type]
        stop_token_ids=[EOS],
        logits_processors=[favour_miles],
        lookup_sources=[passage],
        drafter=drafter,  # type: ignore[arg-type]
        grammar=compiler.json_schema({"enum": ["m", "mile", "km"]}),
    )
    return [token for event in engine.generate(request) for token in event.token_ids]


@pytest.mark.parametrize("cut_words", [True, False])
def test_an_enum_value_cut_short_becomes_the_value_the_model_began(cut_words: bool) -> None:
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    compiler = GrammarCompiler(info, cut_words=cut_words)
    passage = [VOCAB.index(char) for char in '"'] + [VOCAB.index("mile"), VOCAB.index('"')]
    plain = constrained(compiler, "off", passage)
    text = "".join(VOCAB[token] for token in plain)
    if cut_words:
        assert text == '"mile"'
    else:
        assert text == '"m"'  # masking alone drops "miles" and takes the next best
    assert constrained(compiler, "on", passage) == plain  # speculation verifies the same rows
    assert constrained(compiler, "on", passage, drafter="model") == plain  # q poured and masked alike


def test_the_compiler_gives_every_grammar_one_table_for_its_vocabulary() -> None:
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS])
    compiler = GrammarCompiler(info)
    first, second = compiler.json_schema({"enum": ["m"]}), compiler.json_object()
    assert first.word_prefixes is not None and first.word_prefixes is second.word_prefixes
    assert int(first.word_prefixes[MILES]) == VOCAB.index("mile")
    assert GrammarCompiler(info, cut_words=False).json_object().word_prefixes is None
    state = GrammarState(first, [EOS], len(VOCAB))
    assert allowed_tokens(state.next_bitmask(), len(VOCAB))[0, VOCAB.index('"')]


# -- sampling: the poured, masked target is what speculation samples -------------------------

WORD_TOKENS = ["a", "ab", "abx", "x", "y", "b"]  # token i spells WORD_TOKENS[i]; "ab" pours into "a"
WORD_EBNF = 'root ::= item*\nitem ::= "a" [xy] | "x" | "y" | "b"'  # "a" must be followed by x or y


def word_grammar(cut_words: bool = True) -> Grammar:
    info = xgr.TokenizerInfo(WORD_TOKENS, vocab_size=len(WORD_TOKENS), stop_token_ids=[])
    return GrammarCompiler(info, cut_words=cut_words).ebnf(WORD_EBNF)


def word_allowed_after(output: list[int]) -> list[int]:
    """The grammar's allowed next tokens, written out independently of xgrammar."""
    pending_head = False
    for char in "".join(WORD_TOKENS[token] for token in output):
        pending_head = not pending_head and char == "a"
    allowed = ["x", "y"] if pending_head else ["a", "x", "y", "b"]
    return [WORD_TOKENS.index(text) for text in allowed]


def exact_poured_pairs() -> torch.Tensor:
    """P(t2, t3) under the rule written out by hand: "ab" gives its probability to "a"
    where "a" is allowed ("abx" would pour into "ab", which is never allowed), then the
    mask, then the sampling."""
    pours = {WORD_TOKENS.index("ab"): WORD_TOKENS.index("a")}

    def probs(output: list[int]) -> torch.Tensor:
        logits = TARGET.forward(TARGET.new_kv(), [*PROMPT, *output])[-1].double()
        allowed = word_allowed_after(output)
        weights = logits.exp()
        for giver, receiver in pours.items():
            if receiver in allowed:
                weights[receiver] += logits[giver].exp()
        poured = weights.log()
        poured[[token for token in range(len(WORD_TOKENS)) if token not in allowed]] = float("-inf")
        return probs_from_logits(poured, PARAMS)

    joint = torch.zeros(len(WORD_TOKENS), len(WORD_TOKENS), dtype=torch.float64)
    first = probs([])
    for t1, t2 in itertools.product(range(len(WORD_TOKENS)), repeat=2):
        if first[t1] > 0:
            second = probs([t1])
            if second[t2] > 0:
                joint[t2] += first[t1] * second[t2] * probs([t1, t2])
    return joint


@pytest.mark.slow
def test_speculative_sampling_samples_the_poured_target() -> None:
    assert pvalue(sampled_second_and_third_token(word_grammar()), exact_poured_pairs()) > 0.001


@pytest.mark.slow
def test_the_sampling_check_rejects_a_target_masked_without_pouring() -> None:
    """Planted: the grammar masks alone; the law sampled is then the masked target's."""
    assert pvalue(sampled_second_and_third_token(word_grammar(cut_words=False)), exact_poured_pairs()) < 1e-4
