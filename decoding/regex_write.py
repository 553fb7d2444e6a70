"""A DFA written back as one regex (state elimination), in the plain dialect xgrammar reads:
positive character classes, groups, ``|``, ``*``, ``+``, ``?``. Never a negated class, which
would reach characters outside ``regex_dfa.ALPHABET``."""

from __future__ import annotations

from specrag.decoding.regex_dfa import DFA, MAX_REGEX_CHARS, RegexUnsupported

# A regex tree: ("set", chars) | ("cat", parts) | ("alt", parts) | ("star", node) | ("opt", node)
Node = tuple
EMPTY: Node = ("cat", ())
_META = set(".^$*+?()[]{}|/")
_CLASS_META = set("[]^-/")


def _alt(left: Node | None, right: Node) -> Node:
    if left is None:
        return right
    parts: list[Node] = []
    optional = False
    for node in (left, right):
        if node == EMPTY:
            optional = True
        elif node[0] == "opt":
            optional = True
            parts += list(node[1][1]) if node[1][0] == "alt" else [node[1]]
        else:
            parts += list(node[1]) if node[0] == "alt" else [node]
    chars = frozenset().union(*(part[1] for part in parts if part[0] == "set"))
    others = [part for part in parts if part[0] != "set"]
    unique: list[Node] = [("set", chars)] if chars else []
    for part in others:
        if part not in unique:
            unique.append(part)
    joined: Node = unique[0] if len(unique) == 1 else ("alt", tuple(unique)) if unique else EMPTY
    if not optional or joined == EMPTY or joined[0] in ("star", "opt"):
        return joined
    return ("opt", joined)


def _cat(*nodes: Node) -> Node:
    parts: list[Node] = []
    for node in nodes:
        parts += list(node[1]) if node[0] == "cat" else [node]
    return parts[0] if len(parts) == 1 else ("cat", tuple(parts))


def _star(node: Node) -> Node:
    if node == EMPTY:
        return EMPTY
    if node[0] in ("star", "opt"):
        node = node[1]
    return ("star", node)


def to_regex(dfa: DFA) -> str:
    """An anchored regex whose language is the DFA's; RegexUnsupported past MAX_REGEX_CHARS."""
    if not dfa.accepting:
        raise RegexUnsupported("no string satisfies every constraint")
    start, final = -1, -2
    edges: dict[tuple[int, int], Node] = {(start, 0): EMPTY}
    for state in dfa.accepting:
        edges[(state, final)] = EMPTY
    for state, row in enumerate(dfa.transitions):
        by_target: dict[int, set[str]] = {}
        for char, target in row.items():
            by_target.setdefault(target, set()).add(char)
        for target, chars in by_target.items():
            edges[(state, target)] = ("set", frozenset(chars))
    outgoing: dict[int, set[int]] = {}
    incoming: dict[int, set[int]] = {}
    for source, target in edges:
        outgoing.setdefault(source, set()).add(target)
        incoming.setdefault(target, set()).add(source)
    remaining = set(range(len(dfa.transitions)))
    while remaining:
        state = min(remaining, key=lambda s: (len(incoming.get(s, ())) * len(outgoing.get(s, ())), s))
        remaining.discard(state)
        loop = edges.pop((state, state), None)
        sources = incoming.pop(state, set()) - {state}
        targets = outgoing.pop(state, set()) - {state}
        middle = _star(loop) if loop is not None else EMPTY
        for source in sources:
            into = edges.pop((source, state))
            outgoing[source].discard(state)
            for target in targets:
                path = _cat(into, middle, edges[(state, target)])
                combined = _alt(edges.get((source, target)), path)
                if len(_write(combined)) > MAX_REGEX_CHARS:
                    raise RegexUnsupported("the constraint's regex is too long")
                edges[(source, target)] = combined
                outgoing[source].add(target)
                incoming[target].add(source)
        for target in targets:
            del edges[(state, target)]
            incoming[target].discard(state)
    # Anchored, so that a validator's search reads it as the whole match xgrammar enforces.
    text = "^(" + _write(edges[(start, final)]) + ")$"
    if len(text) > MAX_REGEX_CHARS:
        raise RegexUnsupported("the constraint's regex is too long")
    return text


def _write(node: Node) -> str:
    kind = node[0]
    if kind == "set":
        return _char_class(node[1])
    if kind == "cat":
        parts = list(node[1])
        out = []
        index = 0
        while index < len(parts):  # x x* is written x+
            part = parts[index]
            if index + 1 < len(parts) and parts[index + 1] == ("star", part):
                out.append(_atom(part) + "+")
                index += 2
                continue
            out.append(_group(part) if part[0] == "alt" else _write(part))
            index += 1
        return "".join(out)
    if kind == "alt":
        return "|".join(_write(part) for part in node[1])
    suffix = "*" if kind == "star" else "?"
    return _atom(node[1]) + suffix


def _atom(node: Node) -> str:
    if node[0] == "set" or (node[0] == "cat" and not node[1]):
        return _write(node)
    return _group(node)


def _group(node: Node) -> str:
    return "(" + _write(node) + ")"


def _char_class(chars: frozenset[str]) -> str:
    if len(chars) == 1:
        (char,) = chars
        return "\\" + char if char in _META else char
    codes = sorted(ord(char) for char in chars)
    runs: list[list[int]] = []
    for code in codes:
        if runs and code == runs[-1][1] + 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    body = ""
    for low, high in runs:
        first = _class_char(chr(low))
        if high - low >= 2:
            body += first + "-" + _class_char(chr(high))
        else:
            body += "".join(_class_char(chr(code)) for code in range(low, high + 1))
    return "[" + body + "]"


def _class_char(char: str) -> str:
    return "\\" + char if char in _CLASS_META else char
