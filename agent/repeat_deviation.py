"""A repeated call, replaced by the model's cheapest way not to repeat it.

Asked for two values ("What are the prices of ACME and GLOBEX stock?"),
qwen2.5-coder-1.5b calls for the first, and given its result writes the same call again:
it does want a second call, but copies the arguments it has just seen. The loop does not
run a call twice (``agent/call_rules.py``); instead of asking for an answer at once, it
looks for the smallest change to the model's own output that is not a repeat.

The rule, over the output the model wrote: at each position, the margin is how far the
token written was ahead of the best other token the grammar allowed there (logits, after
the request's processors). The position of the smallest margin is where the model was
least sure; the step is generated again with the written token banned at that position
only (with any layout or case variants of it ranked above the alternative), so the model
writes the alternative there and goes on as it would. Positions the grammar alone decides
(keys, braces) have no margin, and only alternatives that change a name or a value
count. The ban is a pure function of the prefix (``BanAt``), so speculation stays exact
while generating again.

The loop (``agent/loop.py``) runs what comes out only when it is a new call whose values
are all written in the question, the earlier calls or their results
(``agent/call_rules.py``: ``grounded``); else it tries the next position, up to
``TRIES``, and then asks for an answer as before. The smallest margin alone does not tell a
wanted second call from a copy: on the tool-use eval's dev half the 1.5B's closest choice
was most often another tool's name (margins 2.6 to 4.0 logits, for "What is the capital
of Kenya?" too), and ACME to GLOBEX, which was wanted, had 3.5.

``MarginRecorder`` sees every row the engine scores, keyed by the output prefix it
follows; rows of rejected drafts are kept too and simply never looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specrag.decoding.grammar import Grammar, GrammarState, allowed_tokens

CANDIDATES = 32  # the best tokens kept per row: the grammar's best alternative is among them
TRIES = 3  # positions tried per repeated step, smallest margin first


@dataclass(frozen=True)
class Deviation:
    position: int  # index into the output tokens
    written: int  # the token written there
    alternative: int  # the best other token the grammar allowed that changes a value
    margin: float  # logit(written) - logit(alternative), >= 0 for a greedy output
    # banned at the position so that the alternative comes first: the written token and the
    # allowed ones ranked between it and the alternative (the same text laid out otherwise)
    banned: tuple[int, ...] = ()


class MarginRecorder:
    """A logits processor that changes nothing and keeps each row's best ``CANDIDATES``."""

    speculative_safe = True

    def __init__(self, prompt_length: int) -> None:
        self.prompt_length = prompt_length
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.vocab_size = 0

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        row = logits.reshape(-1).float()
        self.vocab_size = row.shape[0]
        values, ids = torch.topk(row, min(CANDIDATES, row.shape[0]))
        self.rows[tuple(token_ids[self.prompt_length :])] = (values, ids)
        return logits


class BanAt:
    """A logits processor that forbids some tokens right after one output prefix."""

    speculative_safe = True

    def __init__(self, prompt_length: int, prefix: Sequence[int], tokens: Sequence[int]) -> None:
        self.prompt_length = prompt_length
        self.prefix = tuple(prefix)
        self.tokens = list(tokens)

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(token_ids) - self.prompt_length != len(self.prefix):
            return logits
        if tuple(token_ids[self.prompt_length :]) != self.prefix:
            return logits
        banned = logits.clone()
        banned.reshape(-1)[self.tokens] = float("-inf")
        return banned


def deviations(
    recorder: MarginRecorder,
    output: Sequence[int],
    grammar: Grammar | None,
    spell: Callable[[Sequence[int]], str] | None = None,
    first_position: int = 1,
) -> list[Deviation]:
    """Per position from ``first_position`` on, the grammar's best alternative to the
    output's token, smallest margin first; positions without an alternative have none.

    Position 0 chooses between a call and a text answer; the loop answers in text anyway
    when no deviation is taken, so the default looks from position 1 on. With ``spell``
    (token ids to text), only a change of a name or a value counts: a position inside the
    JSON (after its first ``{``) where the written token and the alternative both hold a
    letter or digit, and the alternative does not write the same text but for whitespace
    and case (the 1.5B's ``ken`` for ``Ken`` looked up the same country).
    The 1.5B's closest choices were otherwise layout (``{"`` for ``{\n``, ``{{`` for
    ``{\n``) or the fence's language (```python for ```json), none a different call."""
    state = GrammarState(grammar, (), recorder.vocab_size) if grammar is not None else None
    found: list[Deviation] = []
    for position, token in enumerate(output):
        if state is not None and state.is_terminated():
            break
        recorded = recorder.rows.get(tuple(output[:position]))
        if recorded is not None and position >= first_position:
            allowed = _allowed(state, recorder.vocab_size)
            changes_value = _value_change_test(spell, output, position)
            deviation = _deviation_at(position, token, recorded, allowed, changes_value)
            if deviation is not None:
                found.append(deviation)
        if state is not None:
            try:
                state.accept(token)
            except AssertionError:  # a stop token the vocabulary's matcher does not know
                break
    return sorted(found, key=lambda deviation: (deviation.margin, deviation.position))


def _allowed(state: GrammarState | None, vocab_size: int) -> torch.Tensor | None:
    if state is None:
        return None
    return allowed_tokens(state.next_bitmask(), vocab_size)[0]


def _value_change_test(
    spell: Callable[[Sequence[int]], str] | None, output: Sequence[int], position: int
) -> Callable[[int], bool]:
    """Whether a token written instead of ``output[position]`` changes a name or a value of
    the call (see ``deviations``); without ``spell``, every token does."""
    if spell is None:
        return lambda candidate: True
    if "{" not in spell(output[:position]) or not _has_word_character(spell(output[position : position + 1])):
        return lambda candidate: False
    written = _without_whitespace(spell(output[position:])).casefold()

    def changes_value(candidate: int) -> bool:
        text = spell([candidate])
        return _has_word_character(text) and not written.startswith(_without_whitespace(text).casefold())

    return changes_value


def _has_word_character(text: str) -> bool:
    return any(char.isalnum() for char in text)


def _without_whitespace(text: str) -> str:
    return "".join(text.split())


def _deviation_at(
    position: int,
    token: int,
    recorded: tuple[torch.Tensor, torch.Tensor],
    allowed: torch.Tensor | None,
    changes_value: Callable[[int], bool],
) -> Deviation | None:
    values, ids = recorded
    written = (ids == token).nonzero().flatten()
    if not len(written):
        return None  # sampled from outside the best candidates: no margin to speak of
    banned = [token]
    for value, candidate in zip(values.tolist(), ids.tolist(), strict=True):
        if candidate == token or (allowed is not None and not bool(allowed[candidate])):
            continue
        if value == float("-inf"):
            return None
        if not changes_value(candidate):
            banned.append(candidate)
            continue
        return Deviation(position, token, candidate, float(values[written[0]]) - value, tuple(banned))
    return None
