"""Row-exact linears and row-exact mode: bits that do not depend on the other rows.

Two promises rest on it. Batching: a sequence's logits in a packed step (several
sequences' tokens in one forward, ``decoding/packed.py``) must be the bits its own forward
gives, or the text would depend on who shares the step; attention is per sequence by the
same call either way, so row-exact linears suffice (``CausalLM.linears_row_exact``).
Speculation: greedy speculative output equals plain greedy output only if every verify row
gets the logits the one-token step at that position gets, which needs per-row attention
too (row-exact mode, ``CausalLM.row_exact``). ``decoding/fast_paths.py`` has the
mechanisms (oneDNN or K-chunked linears, per-row attention); this module decides, by
measurement on the machine at hand, whether they reach bit-exactness:

1. every distinct linear shape of the model is probed: a product over ``PROBE_ROWS`` rows
   against the same rows one at a time, with the layer's own weight, a single row computed
   as two copies or alone (``SkinnyLinear.min_rows``), unchunked first, then with K split
   into chunks of at most ``CHUNK_LIMITS``; the first exact setting is kept. Wider
   products are never trusted: the layer computes more rows in blocks of ``ROW_BLOCK``
   (``SkinnyLinear.row_block``), and prompt rows in products of exactly ``PROMPT_BLOCK``
   rows, zero-padded, where a row's bits there depend on neither the other rows nor its
   place (``SkinnyLinear.prompt_block``). On the AMX Xeon, bf16, most shapes switch
   schedule past 32 rows, smollm2's k/v projection only past 137, and no probe of a few
   wide row counts could have found every switch. (AMX Xeon:
   every shape is exact unchunked with single rows padded to two; one row alone differs
   from many for K > 4096, Qwen's MLP down projections. MKL's float32 GEMMs are not
   row-invariant at any K; oneDNN's float32 inner product is, from two rows on, on the
   AVX512-BF16 EPYC, so a float32 layer tries it first.)
2. where a layer is exact both with and without the padding, it pads, always: the choice
   is a fixed rule, never a timing. Both settings are row-exact, so either keeps
   speculation invisible, but the one-token step itself rounds differently under each, and
   a timed choice made plain greedy output differ between two loads of the same model
   (qwen2.5-coder-1.5b in bf16: one tool-use answer flipped between processes). Two rows
   were also the faster on the AMX machine (oneDNN's one-row bf16 kernels are slow there).
3. a packed forward of three sequences against their forwards alone, bitwise
   (``packed_matches_alone``): the linears are then row-exact for batching.
4. for a dtype whose logits tie (bf16), row-exact mode: ``VERIFY_TOKENS`` one-token steps
   after a random context against one verify forward over the same tokens, every logit
   compared bitwise. float32 stops at 3: its verify rows differ from steps by ~1e-6, the
   near-tie rule of ``decoding/numerics.py``, and the canonical attention would slow
   every step (``enable_row_exact``).

A probe failing leaves the model as it was: a model whose linears are not row-exact gets
one forward per sequence in a step (a packed one would round by the batch), and one not in
row-exact mode is exact only up to near-ties.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specrag.decoding.fast_paths import uses_specrag_attention
from specrag.decoding.linears import SkinnyLinear, even_chunks, onednn_available, pack_for_onednn

if TYPE_CHECKING:
    from specrag.decoding.model import CausalLM

PROBE_ROWS = (2, 3, 17, 32)  # a product over this many rows against its rows one by one
ROW_BLOCK = 32  # = max(PROBE_ROWS): the most rows one product takes in row-exact mode
# Prompt rows per product: the prefill chunk (PREFILL_CHUNK_TOKENS), so a whole chunk is one
# product; the 1.5B's MLP products over 256 rows ran at the speed of 512-row ones and 2.3x
# that of 32-row blocks on the AMX Xeon.
PROMPT_BLOCK = 256
CHUNK_LIMITS = (4096, 2048, 1024)  # largest K per chunk tried, in order
PROBE_CONTEXT = 40  # random context tokens before the model-level probe
VERIFY_TOKENS = 9  # a verify of γ = 8, the policy's usual largest
# Dtypes whose logits tie often enough that a verify must reproduce one-token steps bit for
# bit (canonical attention too); measured: 4 of 10 smollm2 parity prompts diverged in bf16.
TIE_PRONE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LinearSetting:
    """How a layer computes to be row-exact: single rows padded to two, K-chunks, whether
    the padding could be dropped (both row counts are exact; it is kept anyway), and
    whether the product goes through oneDNN (float32)."""

    min_rows: int
    k_chunks: tuple[tuple[int, int], ...]
    padding_optional: bool
    onednn: bool = False
    row_block: int | None = None
    prompt_block: int | None = None
    activation_major: bool = False  # MKL's ``x @ W.T`` in blocks of ``row_block`` rows
    onednn_packed: bool = False  # with ``onednn``: the weight reordered once (``pack_for_onednn``)


_SETTING_BY_SHAPE: dict[tuple[int, int, torch.dtype, str, bool], LinearSetting | None] = {}


def linear_rows_are_exact(layer: SkinnyLinear, generator: torch.Generator) -> bool:
    """Does each row of a many-row product equal that row computed alone (as the layer
    computes a single row: padded to two when ``min_rows`` is 2), bitwise?"""
    in_features = layer.weight.shape[1]
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(layer.weight.device, layer.weight.dtype)
        together = layer(x)
        one_by_one = torch.cat([layer(x[row : row + 1]) for row in range(rows)])
        if not torch.equal(together, one_by_one):
            return False
    return True


def find_row_exact_setting(layer: SkinnyLinear, few_rows: bool = False) -> LinearSetting | None:
    """The first setting that makes ``layer`` row-exact, cheapest first: for ``few_rows`` on
    an AVX512 CPU, a float32 layer through MKL's ``x @ W.T`` in row blocks
    (``mkl_blocks_preferred``, ``mkl_block_setting``), then
    through oneDNN (``linears.onednn_available``), then unchunked with single rows padded
    to two (measured on the AMX Xeon: products of 2..24 rows agree for every Qwen shape,
    K = 8960 included, while one row alone differs from them for K > 4096), unchunked
    one-row, then ever smaller K-chunks. The layer keeps it."""
    generator = torch.Generator().manual_seed(0)
    layer.row_block = layer.prompt_block = None
    if few_rows and mkl_blocks_preferred(layer.weight):
        setting = mkl_block_setting(layer, generator)
        if setting is not None:
            _apply(layer, setting)
            return setting
    in_features = layer.weight.shape[1]
    chunkings = [()] + [even_chunks(in_features, limit) for limit in CHUNK_LIMITS if in_features > limit]
    onednn = onednn_available(layer.weight)
    candidates = [(True, (), True)] if onednn and onednn_packing_preferred(layer.weight) else []
    candidates += [(True, (), False)] if onednn else []
    candidates += [(False, chunks, False) for chunks in chunkings]
    for onednn, chunks, packed in candidates:
        exact = {}
        for min_rows in (2, 1):
            _apply(layer, LinearSetting(min_rows, chunks, False, onednn, onednn_packed=packed))
            exact[min_rows] = linear_rows_are_exact(layer, generator)
        if exact[2] or exact[1]:
            layer.min_rows = 2 if exact[2] else 1
            prompt_block = PROMPT_BLOCK if prompt_block_is_exact(layer, generator) else None
            setting = LinearSetting(
                layer.min_rows, chunks, exact[2] and exact[1], onednn, ROW_BLOCK, prompt_block, onednn_packed=packed
            )
            _apply(layer, setting)
            return setting
    _apply(layer, None)
    return None


def onednn_packing_preferred(weight: torch.Tensor) -> bool:
    """Is oneDNN's product with the weight reordered once (``linears.pack_for_onednn``)
    tried before its per-call reorder: float32 on an AVX512 CPU?

    Measured on the Xeon without native bf16 (AVX512): packed, a row got the same bits in
    every product of 2..40 rows for every smollm2 and Qwen 0.5B shape, and smollm2's
    row-exact step cost 48 ms against 62 (the 9-token verify 63 against 74;
    ``python -m specrag.evals.bench.forward --model smollm2-135m --dtype float32``). On the
    AVX2 EPYC neither form was measured packed, and oneDNN's float32 product was not
    row-exact there: a CPU rule, never a timing, until that machine is measured."""
    return _float32_on_avx512(weight)


def mkl_blocks_preferred(weight: torch.Tensor) -> bool:
    """Can MKL's ``x @ W.T`` in row blocks be tried first for this weight, for a model that
    runs few rows a forward (``CausalLM.few_rows``): float32 on an AVX512 CPU?

    Measured on the Xeon without native bf16 (AVX512), smollm2's float32 shapes: MKL gives a
    row one set of bits in every product of 2..3 rows (576-wide outputs) or 2..15 rows (the
    rest), one row alone other bits, and more rows others again. For 1-2 rows it is 2-3x
    faster than oneDNN's inner product (2 rows of [576 x 1536]: 94 against 256 µs; the LM
    head 5.6 against 8.9 ms), even at 4-8, and 1.5-2x slower from 16 rows (blocks of 15; the
    LM head over 64 rows 121 against 23 ms). With the head left on oneDNN, the engine's
    one-token step went from 86 to 58 ms and a 64-row forward from 236 to 463 ms: the choice
    for one sequence at a time, not for a server's packed steps. On the AVX2 EPYC ``x @ W.T`` with few rows was the slow
    form (module doc of ``decoding/linears.py``), so it is not tried there: a fixed rule by
    CPU and by how the model is used, never a timing (the kernels round apart).
    """
    return _float32_on_avx512(weight)


def _float32_on_avx512(weight: torch.Tensor) -> bool:
    on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
    return on_cpu and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def mkl_block_setting(layer: SkinnyLinear, generator: torch.Generator) -> LinearSetting | None:
    """``x @ W.T`` with single rows padded to two, in blocks of the most rows (up to
    ``ROW_BLOCK``) for which every product of 2..n rows gives each row, at every place,
    the bits of that row computed alone; None if not even two rows do. Every row count is
    probed, not a few: MKL switches kernels at counts a sparse probe would miss."""
    _apply(layer, LinearSetting(2, (), False, activation_major=True))
    x = torch.randn(ROW_BLOCK, layer.weight.shape[1], generator=generator)
    x = x.to(layer.weight.device, layer.weight.dtype)
    alone = torch.cat([layer._padded_product(x[row : row + 1]) for row in range(ROW_BLOCK)])
    block = 1
    while block < ROW_BLOCK and torch.equal(layer._product(x[: block + 1]), alone[: block + 1]):
        block += 1
    if block < 2:
        return None
    unpadded = torch.equal(layer._product(x[:1]), alone[:1])
    prompt_block = PROMPT_BLOCK if prompt_block_is_exact(layer, generator) else None
    return LinearSetting(2, (), unpadded, False, block, prompt_block, activation_major=True)


def prompt_block_is_exact(layer: SkinnyLinear, generator: torch.Generator) -> bool:
    """In a product of exactly ``PROMPT_BLOCK`` rows, are a row's bits independent of the
    other rows and of its place among them?"""
    block = torch.randn(PROMPT_BLOCK, layer.weight.shape[1], generator=generator)
    block = block.to(layer.weight.device, layer.weight.dtype)
    kept = torch.arange(0, PROMPT_BLOCK, 3, device=block.device)
    places = PROMPT_BLOCK - 1 - kept  # every third row, in reverse order, between zero rows
    moved = torch.zeros_like(block)
    moved[places] = block[kept]
    return torch.equal(layer._product(block)[kept], layer._product(moved)[places])


def _apply(layer: SkinnyLinear, setting: LinearSetting | None) -> None:
    packed = setting is not None and setting.onednn and setting.onednn_packed
    if not packed:
        _unpack(layer)
    elif layer.packed_weight is None:  # a layer's weight never changes once loaded
        layer.packed_weight = pack_for_onednn(layer.weight)
    if setting is None:
        layer.onednn, layer.k_chunks, layer.min_rows = False, (), 1
        layer.row_block = layer.prompt_block = None
        layer.activation_major = False
    else:
        layer.onednn, layer.k_chunks, layer.min_rows = setting.onednn, setting.k_chunks, setting.min_rows
        layer.row_block, layer.prompt_block = setting.row_block, setting.prompt_block
        layer.activation_major = setting.activation_major


def unpack_onednn_weights(model: torch.nn.Module) -> None:
    """oneDNN's layers back to the reorder per call (their weights restored): for timing the
    two forms side by side (``evals/bench/forward.py``); the probes chose the packed one."""
    for layer in skinny_linears(model):
        _unpack(layer)


def _unpack(layer: SkinnyLinear) -> None:
    """Drop the packed copy, first restoring a released weight from it (a reorder: the
    same values)."""
    if layer.packed_weight is None:
        return
    if layer.weight.numel() == 0:  # released by release_dense_weights
        layer.weight.data = layer.packed_weight.to_dense()
    layer.packed_weight = None


def release_dense_weights(model: torch.nn.Module) -> int:
    """Free the plain weight of every layer that computes from its packed copy alone, so a
    packed model takes the memory of one copy, not two; returns how many were freed.

    The LM head keeps its weight (``vocab_size`` reads its shape; smollm2's and the Qwen
    models' head is the embedding table too), as does any weight another module shares.
    ``_unpack`` restores a freed weight if the layer ever leaves the packed kernel."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    uses = Counter(id(parameter) for module in model.modules() for parameter in module.parameters(recurse=False))
    freed = 0
    for layer in skinny_linears(model):
        if layer is head or layer.packed_weight is None or uses[id(layer.weight)] > 1:
            continue
        if layer.weight.numel():
            layer.weight.data = layer.weight.new_empty(0)
            freed += 1
    return freed


def find_row_exact_chunking(layer: SkinnyLinear) -> tuple[tuple[int, int], ...] | None:
    """The K-chunks of ``find_row_exact_setting`` (None if no setting is exact)."""
    setting = find_row_exact_setting(layer)
    return None if setting is None else setting.k_chunks


@torch.inference_mode()
def make_linears_row_exact(model: torch.nn.Module, few_rows: bool = False) -> bool:
    """Give every SkinnyLinear the setting that makes it row-exact; False if one has none.

    ``few_rows`` applies to every layer but the LM head: MKL's small-row kernel costs it
    about 2.3 ms a row beyond two (smollm2's [49152 x 576] head, the AVX512 Xeon: 19 ms
    over 9 rows against 10 through oneDNN, 38 against 11 over 16), where the other layers
    stay within 1.2x of oneDNN up to 16 rows, so a verify would pay for the head alone."""
    reset_linears(model)  # a weight released by an earlier call comes back first
    layers = skinny_linears(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for layer in layers:
        layer_few_rows = few_rows and layer is not head
        key = (*layer.weight.shape, layer.weight.dtype, layer.weight.device.type, layer_few_rows)
        if key not in _SETTING_BY_SHAPE:  # the kernel's order depends on shape, not values
            _SETTING_BY_SHAPE[key] = find_row_exact_setting(layer, layer_few_rows)
        setting = _SETTING_BY_SHAPE[key]
        if setting is None:
            reset_linears(model)
            return False
        _apply(layer, setting)
    if isinstance(head, SkinnyLinear):  # it reads only the kept rows, never the prompt-row layout
        head.prompt_block = None
    return bool(layers)


def linear_kernels(model: torch.nn.Module) -> dict[str, int]:
    """How many linears compute each way: ``mkl_blocks``, ``onednn_packed``, ``onednn``, ``k_chunked``,
    ``padded`` (row-exact, one row as two), ``any_rows`` (row-exact as is) or ``unexact``."""
    counts: Counter[str] = Counter()
    for layer in skinny_linears(model):
        if layer.activation_major:
            counts["mkl_blocks"] += 1
        elif layer.onednn:
            counts["onednn" if layer.packed_weight is None else "onednn_packed"] += 1
        elif layer.k_chunks:
            counts["k_chunked"] += 1
        elif layer.row_block is None:
            counts["unexact"] += 1
        else:
            counts["padded" if layer.min_rows == 2 else "any_rows"] += 1
    return dict(counts)


def reset_linears(model: torch.nn.Module) -> None:
    for layer in skinny_linears(model):
        _apply(layer, None)


def skinny_linears(model: torch.nn.Module) -> list[SkinnyLinear]:
    """The model's linear layers that ``install_fast_paths`` made ``SkinnyLinear``."""
    return [module for module in model.modules() if isinstance(module, SkinnyLinear)]


@torch.inference_mode()
def verify_matches_steps(lm: CausalLM, seed: int = 0) -> bool:
    """One verify forward against one-token steps over the same random tokens, bitwise."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.vocab_size, (PROBE_CONTEXT + VERIFY_TOKENS,), generator=generator).tolist()
    context, appended = ids[:PROBE_CONTEXT], ids[PROBE_CONTEXT:]
    stepped_kv, verified_kv = lm.new_kv(), lm.new_kv()
    lm.prefill(stepped_kv, context)
    lm.prefill(verified_kv, context)
    stepped = torch.cat([lm.forward(stepped_kv, [token]) for token in appended])
    return torch.equal(stepped, lm.forward(verified_kv, appended))


@torch.inference_mode()
def packed_matches_alone(lm: CausalLM, seed: int = 0) -> bool:
    """A step, a verify and a short append of three sequences in one packed forward
    against each sequence's own forward, every logit compared bitwise."""
    from specrag.decoding.packed import Chunk, packed_forward  # packed imports the model module

    generator = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(0, lm.vocab_size, (length,), generator=generator).tolist() for length in (40, 7, 23)]
    appends = [torch.randint(0, lm.vocab_size, (length,), generator=generator).tolist() for length in (1, 9, 3)]
    alone_kvs, packed_kvs = [lm.new_kv() for _ in contexts], [lm.new_kv() for _ in contexts]
    for context, alone_kv, packed_kv in zip(contexts, alone_kvs, packed_kvs, strict=True):
        lm.prefill(alone_kv, context)
        lm.prefill(packed_kv, context)
    alone = [lm.forward(kv, tokens) for kv, tokens in zip(alone_kvs, appends, strict=True)]
    packed = packed_forward(lm, [Chunk(kv, tokens) for kv, tokens in zip(packed_kvs, appends, strict=True)])
    return all(torch.equal(one, other) for one, other in zip(alone, packed, strict=True))


def enable_row_exact(lm: CausalLM) -> bool:
    """Make ``lm``'s linears row-exact if the probes show a packed step is then bit-exact
    here (``linears_row_exact``); for a dtype whose logits tie (bf16), switch it to
    row-exact mode too if a verify then reproduces one-token steps. Returns ``row_exact``.

    float32 keeps the fast attention kernels: its verify rows differ from one-token steps
    by about 1e-6 of a logit, greedy output stayed identical in every run here (the
    near-tie rule, ``decoding/numerics.py``), and the canonical attention that removes the
    difference cost smollm2's float32 one-token step 5% at 400 positions and 24% at 1,500.
    """
    if not uses_specrag_attention(lm.model):
        return False
    if not make_linears_row_exact(lm.model, lm.few_rows):
        return False
    if packed_matches_alone(lm):
        lm.linears_row_exact = True
        if lm.dtype not in TIE_PRONE_DTYPES:
            release_dense_weights(lm.model)
            return False
        lm.row_exact = True
        if verify_matches_steps(lm):
            release_dense_weights(lm.model)
            return True
    lm.row_exact = lm.linears_row_exact = False
    reset_linears(lm.model)
    return False
