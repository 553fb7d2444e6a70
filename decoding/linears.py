"""The CPU fast path and the row-exact forms of a model's linear layers (``SkinnyLinear``).

Speed. Measured on this project's AVX2 machine (``python -m specrag.evals.bench.forward``
and the numbers in the docs): MKL's float32 GEMM for ``x @ W.T`` with few rows of ``x``
(``F.linear``) is slow: for an [8960 x 1536] weight, 4 rows took 17 ms against 5 ms for
one row. Computing the same product as ``(W @ x.T).T``, the big matrix as the M dimension,
took 4.9 ms. Never slower for any k measured up to 512, so every float32 ``nn.Linear``
uses it on CPU. bf16 is the other way round: oneDNN's ``x @ W.T`` is the faster form, on
both native-bf16 CPUs measured (the 1.5B's matmuls of a one-token step inside the model:
97 ms against 125 ms on the AVX512-BF16 EPYC; the whole step 254 against 319 ms on the
AMX Xeon), so bf16 layers keep ``F.linear``'s form, a fixed rule by dtype (never a
timing: the two forms round differently, and the text must not depend on which was
faster at load).

Exactness (row-exact mode, ``decoding/batch_invariance.py`` decides when it is on): on
the native-bf16 CPU, oneDNN's bf16 GEMM gives a row the same bits whatever the other
rows, as long as the reduction dimension K is at most 4096; a longer K is accumulated in
an order that depends on the row count. So a layer with a long K sums fixed K-chunks in
float32 in a fixed order (``k_chunks``), the same for one row as for many. Attention's
side of row-exactness is in ``decoding/fast_paths.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PROMPT_ROWS", "PromptRows", "SkinnyLinear", "even_chunks", "onednn_available", "pack_for_onednn"]

# The row count oneDNN is told to expect when it reorders a weight (``pack_for_onednn``).
# Measured on the AVX512 Xeon without native bf16, float32, every hint from 4 to 256 gave
# the same speed within noise for 1..32 rows and a row the same bits in every product of
# 2..40 rows; a hint of 1 gave the slow unpacked kernel. A fixed value: the layout decides
# the rounding, so it must never follow a timing.
ONEDNN_ROWS_HINT = 16


@dataclass(frozen=True)
class PromptRows:
    """Which rows of the forward under way are prompt rows: index tensors of the prompt
    rows and of the others among ``total``, built on the host once per forward, so a
    linear reads no flag off the device (a sync per layer on a GPU)."""

    total: int
    prompt: torch.Tensor
    other: torch.Tensor

    @classmethod
    def of(cls, flags: Sequence[bool], device: torch.device | str = "cpu") -> PromptRows:
        prompt = [row for row, flag in enumerate(flags) if flag]
        other = [row for row, flag in enumerate(flags) if not flag]
        as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return cls(len(flags), as_index(prompt), as_index(other))


# Set by ``decoding/packed.py`` for a forward with prompt rows: row-blocked linears compute
# them apart (``SkinnyLinear.prompt_block``). None: no prompt rows, or a forward outside it.
PROMPT_ROWS: ContextVar[PromptRows | None] = ContextVar("specrag_prompt_rows", default=None)


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` in the product form that is fast on few rows for its dtype: ``(W @ x.T).T``
    in float32, ``F.linear``'s own ``x @ W.T`` in bf16 (see module doc).

    With ``k_chunks`` set (row-exact mode), the reduction runs over those column ranges
    of W one at a time and is summed in float32 in that order. With ``min_rows`` 2, a
    one-row product is computed as two copies of the row: on the AMX machine oneDNN's
    one-row bf16 kernel was 1.2-1.7x slower than its two-row one for every shape of the
    1.5B (``evals/bench/forward.py``); row-exactness makes the padded row's bits the same.

    With ``row_block`` set, a product over more rows is computed in blocks of that many:
    on the AMX Xeon oneDNN's bf16 kernel gives a row the same bits in any product of 2..32
    rows but switches schedule beyond (at 33 rows for most of the 1.5B's shapes), so a
    packed step of 36 rows would round its sequences' rows apart from their own forwards.
    Prompt rows (``PROMPT_ROWS``) go instead in products of exactly ``prompt_block`` rows,
    zero-padded: there a row's bits depend on the product's row count only, not on the
    other rows nor its place, so a prompt gets the same bits however it is cut into chunks,
    at the speed of a wide product (256 rows: 19-21 ms for the 1.5B's MLP shapes against
    50 in 32-row blocks, per 1,024 rows).
    """

    k_chunks: tuple[tuple[int, int], ...] = ()
    min_rows: int = 1
    onednn: bool = False  # row-exact float32: oneDNN's inner product (``onednn_available``)
    packed_weight: torch.Tensor | None = None  # with ``onednn``: the weight in oneDNN's own layout
    row_block: int | None = None  # row-exact: most rows in one product (None: any number)
    prompt_block: int | None = None  # row-exact: prompt rows per product, exactly (None: as any row)
    activation_major: bool = False  # row-exact: ``x @ W.T`` whatever the dtype (MKL's row blocks)

    @property
    def weight_major(self) -> bool:
        """``(W @ x.T).T`` (float32) rather than ``x @ W.T`` (bf16, fp16): see the module doc."""
        return self.weight.dtype == torch.float32 and not self.activation_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        layout = PROMPT_ROWS.get() if self.prompt_block is not None else None
        if layout is not None and layout.total == rows.shape[0] and layout.prompt.numel():
            out = rows.new_empty(rows.shape[0], self.out_features)
            out[layout.prompt] = self._prompt_product(rows[layout.prompt])
            if layout.other.numel():
                out[layout.other] = self._blocked_product(rows[layout.other])
        else:
            out = self._blocked_product(rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _blocked_product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.row_block is None or rows.shape[0] <= self.row_block:
            return self._padded_product(rows)
        return torch.cat([self._padded_product(block) for block in rows.split(self.row_block)])

    def _padded_product(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        if count < self.min_rows:
            rows = rows.expand(self.min_rows, -1).contiguous()
        return self._product(rows)[:count]

    def _prompt_product(self, rows: torch.Tensor) -> torch.Tensor:
        size = self.prompt_block
        assert size is not None
        parts = []
        for block in rows.split(size):
            count = block.shape[0]
            padding = block.new_zeros(size - count, block.shape[1])
            parts.append(self._product(torch.cat([block, padding]) if count < size else block)[:count])
        return torch.cat(parts)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.k_chunks:
            return self._chunked_product(rows)
        if self.onednn:
            weight = self.weight if self.packed_weight is None else self.packed_weight
            return torch.ops.mkldnn._linear_pointwise(rows, weight, self.bias, "none", [], "")
        if not self.weight_major:
            return F.linear(rows, self.weight, self.bias)
        # The bias goes inside the GEMM (addmm), rounded once with the product as F.linear
        # does. Added after a bf16 product it is a second rounding, and Qwen's large q/k
        # biases then cost real accuracy: qwen2.5-coder-1.5b in bf16 answered a tool result
        # "95.0 fahrenheit" with the description of another tool, where F.linear did not.
        if self.bias is None:
            product = torch.mm(self.weight, rows.t())
        else:
            product = torch.addmm(self.bias.unsqueeze(1), self.weight, rows.t())
        # contiguous: a transposed output would give attention a head dim with stride != 1,
        # which pushes SDPA off its flash kernel onto the slow math path.
        return product.t().contiguous()

    def _chunked_product(self, rows: torch.Tensor) -> torch.Tensor:
        accumulate = torch.promote_types(rows.dtype, torch.float32)
        total = torch.zeros(rows.shape[0], self.weight.shape[0], dtype=accumulate, device=rows.device)
        for start, end in self.k_chunks:  # slices, not copies: measured as fast, no extra memory
            weight, part = self.weight[:, start:end], rows[:, start:end]
            total.add_(torch.mm(weight, part.t()).t() if self.weight_major else torch.mm(part, weight.t()))
        if self.bias is not None:  # in float32, before the one rounding to the model's dtype
            total.add_(self.bias)
        return total.to(rows.dtype)


def onednn_available(weight: torch.Tensor) -> bool:
    """Can this weight's product go through oneDNN's inner product (a CPU float32 weight)?

    Measured on the AVX512-BF16 EPYC: MKL's float32 GEMM gives a row other bits with 1,
    2-3, 4+ rows (and again for remainder rows), at every K, so no K-chunking makes it
    row-exact; oneDNN's float32 inner product gives a row the same bits for every row count
    from 2 to 1100, for every SmolLM2 and Qwen 0.5B shape, and only one row alone differs.
    So row-exact float32 pads one row to two (``min_rows``) and uses it. It was also no
    slower: smollm2 float32 one-token steps ran 1.00-1.03x as fast as through MKL at 64,
    400 and 1,500 positions (same-process A/B, 8 alternating repeats).
    ``decoding/batch_invariance.py`` still probes every shape before using it.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered once into oneDNN's blocked layout, for ``_linear_pointwise``.

    Unpacked, oneDNN reorders the weight on every call: on the AVX512 Xeon without native
    bf16 that made 2 rows 1.6-3.4x slower than packed for smollm2's and the 0.5B's shapes
    (``python -m specrag.evals.bench.matmul --kernels``), and smollm2's whole row-exact
    step cost 62 ms against 48 packed (``evals/bench/forward.py``). Packed, a row had the
    same bits in every product of 2..40 rows there. The copy is extra memory, the size of
    the weight. ``decoding/batch_invariance.py`` probes it before use."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)


def even_chunks(length: int, max_chunk: int) -> tuple[tuple[int, int], ...]:
    """``length`` split into the fewest near-equal ranges of at most ``max_chunk``."""
    count = -(-length // max_chunk)
    size = -(-length // count)
    return tuple((start, min(start + size, length)) for start in range(0, length, size))
