"""A word the grammar cuts short: its probability goes to the part the grammar allows.

Token by token, a grammar can only forbid. Where the model's likeliest token spells a
longer word than the grammar admits, masking drops that token's probability and the best
allowed token wins, which is often the end of the value rather than the word's allowed
part: after ``"to_unit": "m`` with the enum ["km", "mile", "m", "foot"],
qwen2.5-coder-0.5b gave 0.745 to ``iles`` (forbidden), 0.137 to ``"}}`` and 0.022 to
``ile``, so masked greedy wrote "m" (metres) for miles: 4 of the 17 tool-use tasks it got
wrong on the dev half (float32).

The rule, applied to a row before the grammar's mask: each of the row's ``TOP`` likeliest
tokens that the grammar forbids and whose text is a word (letters and digits, after at
most one leading space) gives its probability to the token spelling the same word less
its last letter, if the grammar allows that one. A model that wanted ``iles`` after
``"m`` wanted a text that starts with ``ile``: the same word with one letter more (a
plural, a case ending). Cut shorter, a prefix is mostly the start of another word: the
0.5B wanted a tool named ``break``, and pouring it into ``b`` called ``book_meeting``
(held-out task t067, where masking alone had called ``add_days``; both wrong). Tokens that
are not words (punctuation, quotes, markup such as ``<tool_call>``) give nothing: their
prefixes are other structure, not the same intent. Allowed tokens only ever gain, so the
mask afterwards is unchanged and the result stays valid under the grammar.

The transform reads only the row's own logits and mask, so a verify row and the plain
step's row get the same result from the same logits: greedy speculation stays equal to
plain greedy and sampling stays exact, the target's distribution being this transformed
one, with the draft model's q transformed alike (``decoding/grammar.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOP = 16  # forbidden tokens considered per row: the likeliest ones, where the mass is
NO_PREFIX = -1


def _word(text: bytes) -> tuple[bool, bytes] | None:
    """(leading space, the word) when ``text`` is a word token, else None."""
    space = text.startswith(b" ")
    word = text[1:] if space else text
    return (space, word) if word and word.isalnum() else None


def word_prefix_table(decoded_vocab: Sequence[bytes]) -> torch.Tensor:
    """For each token id, the id of the word token spelling its text less the last letter,
    with the same leading space (``NO_PREFIX`` where there is none or the token is no
    word). The lowest id wins among tokens spelling the same text."""
    ids: dict[bytes, int] = {}
    for token_id, text in enumerate(decoded_vocab):
        if _word(text) is not None:
            ids.setdefault(text, token_id)
    table = torch.full((len(decoded_vocab),), NO_PREFIX, dtype=torch.int64)
    for token_id, text in enumerate(decoded_vocab):
        parsed = _word(text)
        if parsed is not None and len(parsed[1]) > 1 and text[:-1] in ids:
            table[token_id] = ids[text[:-1]]
    return table


def _allowed(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whether xgrammar's int32 ``bitmask`` rows [R, W] allow ``ids`` [R, K] (ids >= 0)."""
    words = bitmask.gather(1, ids >> 5)
    return ((words >> (ids & 31)) & 1).bool()


def pour_cut_words(logits: torch.Tensor, bitmask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``logits`` [R, V] with each cut word's probability moved to the word less its last
    letter where the grammar allows that (module docstring); call before the mask. A new
    tensor; rows without a cut word keep their values."""
    bitmask = bitmask.to(logits.device)
    table = table.to(logits.device)
    values, ids = logits.topk(min(TOP, logits.shape[-1]), dim=-1)
    target = table[ids]
    found = ~_allowed(bitmask, ids) & torch.isfinite(values) & (target != NO_PREFIX)
    found &= _allowed(bitmask, target.clamp(min=0))
    if not found.any():
        return logits
    # Every write to a token carries its whole new value, so repeated targets agree:
    # new(t) = log(exp(old(t)) + sum of the givers' exp(logit)), relative to the row's best.
    destination = torch.where(found, target, ids)
    best = values[:, :1]
    given = torch.where(found, (values - best).exp(), torch.zeros_like(values))
    same = destination.unsqueeze(-1) == destination.unsqueeze(-2)  # [R, K, K]
    inflow = (same & found.unsqueeze(-2)).to(given.dtype) @ given.unsqueeze(-1)  # [R, K, 1]
    inflow = inflow.squeeze(-1)
    old = logits.gather(1, destination)
    # Tokens nothing flows to are written back as they were, not recomputed (no rounding).
    new = torch.where(inflow > 0, best + torch.log((old - best).exp() + inflow), old)
    return logits.scatter(1, destination, new)
