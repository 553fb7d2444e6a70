"""String constraints as automata: intersection, complement and emptiness, and back to one
regex xgrammar can enforce.

xgrammar 0.2.9 compiles a ``pattern`` on its own: no lookaround, ``minLength``/``maxLength``
beside a pattern are ignored, and ``not`` is not compiled at all. Over strings those are
all regular: "matches P, is 3 to 39 characters long, does not start with ``org.bukkit.``,
is none of these names". Each part becomes a DFA (Python's own regex parser reads the
pattern), the parts are intersected, and the product is written back as one plain regex by
state elimination, so the schema keeps a single ``pattern`` that xgrammar enforces.

Semantics, chosen so that whatever the grammar writes validates:
- a *written* pattern is matched whole, as xgrammar matches it (stricter than JSON
  Schema's search semantics); a *negated* pattern uses the search semantics a validator
  applies, so that its complement is exact;
- strings are over ``ALPHABET``: printable ASCII without ``"`` and ``\\`` (which JSON would
  escape). Within it ``\\d``, ``\\w``, ``\\s``, ``.`` and negated classes mean the same to
  ECMA-262 and to Python's Unicode rules, so a negation computed here is exact for the
  validator too.

Anything else (backreferences, lookaround past the start, anchors inside, inline flags)
raises ``RegexUnsupported``; the caller refuses the keyword.
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_STATES = 3000  # an automaton past this is refused rather than compiled
MAX_REGEX_CHARS = 20_000

ALPHABET: tuple[str, ...] = tuple(chr(code) for code in range(0x20, 0x7F) if chr(code) not in '"\\')
_CHARS = frozenset(ALPHABET)
_CATEGORIES: dict[object, frozenset[str]] = {
    sre_c.CATEGORY_DIGIT: frozenset("0123456789"),
    sre_c.CATEGORY_WORD: frozenset(c for c in ALPHABET if c.isalnum() or c == "_"),
    sre_c.CATEGORY_SPACE: frozenset(" "),  # the only whitespace in ALPHABET
    sre_c.CATEGORY_NOT_DIGIT: _CHARS - frozenset("0123456789"),
    sre_c.CATEGORY_NOT_WORD: frozenset(c for c in ALPHABET if not (c.isalnum() or c == "_")),
    sre_c.CATEGORY_NOT_SPACE: _CHARS - frozenset(" "),
}
_REPEATS = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT)


class RegexUnsupported(ValueError):
    """A regex feature, or a size, this module does not turn into an automaton."""


@dataclass(frozen=True)
class DFA:
    """``transitions[state]`` maps a character to the next state (absent: rejected); state 0 starts."""

    transitions: tuple[dict[str, int], ...]
    accepting: frozenset[int]

    def matches(self, text: str) -> bool:
        state = 0
        for char in text:
            if char not in self.transitions[state]:
                return False
            state = self.transitions[state][char]
        return state in self.accepting


# -- building ----------------------------------------------------------------------------------


class _NFA:
    """Thompson NFA: per state a list of (characters, or None for epsilon, target)."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[str] | None, int]]] = []

    def state(self) -> int:
        self.edges.append([])
        if len(self.edges) > 4 * MAX_STATES:
            raise RegexUnsupported("the pattern is too large")
        return len(self.edges) - 1

    def edge(self, source: int, chars: frozenset[str] | None, target: int) -> None:
        self.edges[source].append((chars, target))

    def sequence(self, items: Sequence[tuple[object, object]], start: int) -> int:
        state = start
        for op, argument in items:
            state = self.item(op, argument, state)
        return state

    def item(self, op: object, argument: object, start: int) -> int:
        if op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN):
            end = self.state()
            self.edge(start, _charset(op, argument), end)
            return end
        if op is sre_c.SUBPATTERN:
            _group, add_flags, del_flags, body = argument  # type: ignore[misc]
            if add_flags or del_flags:
                raise RegexUnsupported("inline flags")
            return self.sequence(list(body), start)
        if op is sre_c.ATOMIC_GROUP:
            return self.sequence(list(argument), start)  # type: ignore[call-overload]
        if op is sre_c.BRANCH:
            end = self.state()
            for alternative in argument[1]:  # type: ignore[index]
                self.edge(self.sequence(list(alternative), start), None, end)
            return end
        if op in _REPEATS:
            low, high, body = argument  # type: ignore[misc]
            return self.repeat(list(body), low, high, start)
        raise RegexUnsupported(f"{str(op).lower()} inside the pattern")

    def repeat(self, body: list[tuple[object, object]], low: int, high: object, start: int) -> int:
        if low > 256 or (high is not sre_c.MAXREPEAT and high > 256):  # type: ignore[operator]
            raise RegexUnsupported("a repeat count over 256")
        state = start
        for _ in range(low):
            state = self.sequence(body, state)
        if high is sre_c.MAXREPEAT:
            loop = self.state()
            self.edge(state, None, loop)
            self.edge(self.sequence(body, loop), None, loop)
            return loop
        end = self.state()
        self.edge(state, None, end)
        for _ in range(high - low):  # type: ignore[operator]
            state = self.sequence(body, state)
            self.edge(state, None, end)
        return end


def _charset(op: object, argument: object) -> frozenset[str]:
    if op is sre_c.LITERAL:
        return frozenset({chr(argument)}) & _CHARS  # type: ignore[arg-type]
    if op is sre_c.NOT_LITERAL:
        return _CHARS - {chr(argument)}  # type: ignore[arg-type]
    if op is sre_c.ANY:
        return _CHARS
    negate, chars = False, set()
    for kind, value in argument:  # type: ignore[attr-defined]
        if kind is sre_c.NEGATE:
            negate = True
        elif kind is sre_c.LITERAL:
            chars.add(chr(value))
        elif kind is sre_c.RANGE:
            chars.update(chr(code) for code in range(value[0], min(value[1], 0x7E) + 1))
        elif kind is sre_c.CATEGORY and value in _CATEGORIES:
            chars.update(_CATEGORIES[value])
        else:
            raise RegexUnsupported(f"character class item {str(kind).lower()}")
    return _CHARS - chars if negate else frozenset(chars) & _CHARS


def _dfa(nfa: _NFA, start: int, accept: int) -> DFA:
    """Subset construction."""

    def closure(states: Iterable[int]) -> frozenset[int]:
        seen, stack = set(states), list(states)
        while stack:
            for chars, target in nfa.edges[stack.pop()]:
                if chars is None and target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)

    first = closure([start])
    index = {first: 0}
    order = [first]
    transitions: list[dict[str, int]] = []
    for subset in order:
        moves: dict[str, set[int]] = {}
        for state in subset:
            for chars, target in nfa.edges[state]:
                for char in chars or ():
                    moves.setdefault(char, set()).add(target)
        row = {}
        for char, targets in moves.items():
            target_set = closure(targets)
            if target_set not in index:
                index[target_set] = len(order)
                order.append(target_set)
                if len(order) > MAX_STATES:
                    raise RegexUnsupported("the automaton is too large")
            row[char] = index[target_set]
        transitions.append(row)
    return minimize(DFA(tuple(transitions), frozenset(i for i, s in enumerate(order) if accept in s)))


def _split(pattern: str) -> tuple[bool, list[tuple[bool, list[tuple[object, object]]]], list, bool]:
    """(anchored at start, lookaheads at the start, the body's items, anchored at end)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise RegexUnsupported(f"not a regex Python can read: {error}") from None
    if parsed.state.flags & ~sre_c.SRE_FLAG_UNICODE:
        raise RegexUnsupported("inline flags")
    items = list(parsed)
    at_start = at_end = False
    while items and items[0] == (sre_c.AT, sre_c.AT_BEGINNING):
        items.pop(0)
        at_start = True
    lookaheads = []
    while items and items[0][0] in (sre_c.ASSERT, sre_c.ASSERT_NOT) and items[0][1][0] == 1:
        lookaheads.append((items[0][0] is sre_c.ASSERT_NOT, list(items[0][1][1])))
        items.pop(0)
    while items and items[-1] == (sre_c.AT, sre_c.AT_END):
        items.pop()
        at_end = True
    return at_start, lookaheads, items, at_end


def _build(items: list[tuple[object, object]], any_before: bool = False, any_after: bool = False) -> DFA:
    nfa = _NFA()
    start = nfa.state()
    state = start
    if any_before:
        state = nfa.repeat([(sre_c.ANY, None)], 0, sre_c.MAXREPEAT, state)
    state = nfa.sequence(items, state)
    if any_after:
        state = nfa.repeat([(sre_c.ANY, None)], 0, sre_c.MAXREPEAT, state)
    return _dfa(nfa, start, state)


def whole_match(pattern: str) -> DFA:
    """Strings the pattern matches as a whole; lookaheads at its start are honoured."""
    at_start, lookaheads, items, _at_end = _split(pattern)
    if lookaheads and not at_start:
        raise RegexUnsupported("a lookahead that is not anchored at the start")
    result = _build(items)
    for negated, body in lookaheads:
        prefix = _build(body, any_after=True)
        result = intersect(result, complement(prefix) if negated else prefix)
    return result


def search(pattern: str) -> DFA:
    """Strings that contain a match (``re.search``, the validator's reading)."""
    at_start, lookaheads, items, at_end = _split(pattern)
    if lookaheads:
        raise RegexUnsupported("a lookahead inside a negated pattern")
    return _build(items, any_before=not at_start, any_after=not at_end)


def literals(strings: Iterable[str]) -> DFA:
    """Exactly these strings."""
    nfa = _NFA()
    start, accept = nfa.state(), nfa.state()
    for text in strings:
        nfa.edge(nfa.sequence([(sre_c.LITERAL, ord(char)) for char in text], start), None, accept)
    return _dfa(nfa, start, accept)


def length_between(low: int, high: int | None) -> DFA:
    """Any string of ``low`` to ``high`` characters (``None``: no upper bound)."""
    nfa = _NFA()
    start = nfa.state()
    end = nfa.repeat([(sre_c.ANY, None)], low, sre_c.MAXREPEAT if high is None else high, start)
    return _dfa(nfa, start, end)


# -- operations --------------------------------------------------------------------------------


def intersect(left: DFA, right: DFA) -> DFA:
    index = {(0, 0): 0}
    order = [(0, 0)]
    transitions: list[dict[str, int]] = []
    for a, b in order:
        row = {}
        for char, a_next in left.transitions[a].items():
            b_next = right.transitions[b].get(char)
            if b_next is None:
                continue
            pair = (a_next, b_next)
            if pair not in index:
                index[pair] = len(order)
                order.append(pair)
                if len(order) > MAX_STATES:
                    raise RegexUnsupported("the automaton is too large")
            row[char] = index[pair]
        transitions.append(row)
    accepting = frozenset(i for i, (a, b) in enumerate(order) if a in left.accepting and b in right.accepting)
    return minimize(DFA(tuple(transitions), accepting))


def complement(dfa: DFA) -> DFA:
    """Every string over ALPHABET the DFA rejects."""
    sink = len(dfa.transitions)
    transitions = [{char: row.get(char, sink) for char in ALPHABET} for row in dfa.transitions]
    transitions.append(dict.fromkeys(ALPHABET, sink))
    accepting = frozenset(range(sink + 1)) - dfa.accepting
    return minimize(DFA(tuple(transitions), accepting))


def is_empty(dfa: DFA) -> bool:
    return not dfa.accepting


def equivalent(left: DFA, right: DFA) -> bool:
    return is_empty(intersect(left, complement(right))) and is_empty(intersect(right, complement(left)))


def minimize(dfa: DFA) -> DFA:
    """Only states that can reach acceptance, then Moore's partition refinement."""
    live = set(dfa.accepting)
    changed = True
    while changed:
        changed = False
        for state, row in enumerate(dfa.transitions):
            if state not in live and any(target in live for target in row.values()):
                live.add(state)
                changed = True
    if 0 not in live:
        return DFA(({},), frozenset())
    rows = {s: {c: t for c, t in dfa.transitions[s].items() if t in live} for s in live}
    block = {s: int(s in dfa.accepting) for s in live}
    while True:
        signatures = {s: (block[s], tuple(sorted((c, block[t]) for c, t in rows[s].items()))) for s in live}
        numbering: dict[object, int] = {}
        for s in sorted(live, key=lambda s: (s != 0, s)):  # the start state's block is 0
            numbering.setdefault(signatures[s], len(numbering))
        refined = {s: numbering[signatures[s]] for s in live}
        if len(numbering) == len(set(block.values())):
            break
        block = refined
    block = refined
    count = len(set(block.values()))
    transitions: list[dict[str, int]] = [{} for _ in range(count)]
    for s in live:
        transitions[block[s]] = {c: block[t] for c, t in rows[s].items()}
    return DFA(tuple(transitions), frozenset(block[s] for s in dfa.accepting if s in live))
