"""Fast paths for the forwards speculative decoding makes (CPU first), and the row-exact mode.

Speed. Measured on this project's AVX2 machine (``python -m specrag.evals.bench.forward`` and the
numbers in the docs), two things made a verify forward over k = 2..16 tokens cost far
more than a one-token step, although both read the same weights:

1. MKL's float32 GEMM with few rows is slow, so linears take the weight-major form in
   float32 (``SkinnyLinear``, ``decoding/linears.py``).
2. transformers' SDPA path repeats the KV heads of grouped-query attention
   (``repeat_kv``: a copy of the whole cache per layer per forward) whenever a mask is
   needed, i.e. for every verify forward. ``enable_gqa=True`` lets the kernel share heads.

Exactness (row-exact mode, ``decoding/batch_invariance.py`` decides when it is on). Greedy
speculation is only exact if the verify forward over k tokens gives each row the logits k
one-token steps would give, bit for bit: in bfloat16 the logits are coarse enough that
exact ties are common, and any rounding difference flips them. The linears' side is in
``decoding/linears.py``. Attention over several new
query rows uses a different kernel schedule from one query row, so in row-exact mode every
append, a one-token step included, is attended in one canonical form: query rows in
blocks of a fixed height over keys padded to a fixed bucket and masked, so a one-token
step is one row of the same kernel call a verify makes. Both sides only change how the
same sums are ordered; all of specrag's paths (plain step, verify, draft) and the transformers
reference in the benchmark run the same weights.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specrag.decoding.linears import SkinnyLinear
from specrag.decoding.tree_attention import attend_tree, attend_tree_masked

ATTENTION_NAME = "specrag_sdpa"
# The keyword CausalLM.forward passes through transformers to the attention function when
# the new tokens are a plain causal append to the cache (no tree, no padding), which is
# what the per-row path assumes.
ROW_EXACT_KWARG = "specrag_row_exact"
# The keyword ``decoding/packed.py`` passes its cache under: the new tokens are chunks of
# several sequences, each attending to its own sequence's keys only.
PACKED_KWARG = "specrag_packed"
# Longer appends are prompt prefills, shared by every path: they keep the fast kernel.
ROW_EXACT_MAX_QUERY = 64
# Row-exact attention pads each row's keys (masked) to a multiple of this; GrowableLayer's
# capacities are multiples of it, so the padding is read from the cache buffer, not copied.
ROW_EXACT_KEY_BUCKET = 32
# ... and attends query rows in blocks of exactly this many (a step is one row of a block).
ROW_EXACT_QUERY_BLOCK = 16
# Prompt rows are attended in blocks aligned to multiples of this many positions (the
# prefix cache's block size), each over exactly the keys up to its block's end, so a
# prompt row gets the same bits however the prompt is cut into prefill chunks.
PREFILL_BLOCK = 32


def _attend_rows_canonically(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention for an append of q tokens (q = 1 for a one-token step) in the one form
    every path shares, so that a verify row gets the bits the one-token step at its
    position gets.

    Row i sees the first ``L - q + i + 1`` keys. Rows are attended in blocks of exactly
    ``ROW_EXACT_QUERY_BLOCK`` query rows (unused rows zero, seeing one key) over keys
    padded to the next multiple of ``ROW_EXACT_KEY_BUCKET`` and masked, so a step and a
    verify make the same kernel call with the same shapes. Measured on the AMX Xeon
    (``tests/test_batch_invariance.py`` checks it on the machine at hand): the kernel's
    result for one row of a block does not depend on the other rows or on the row's
    place in the block, while a block of a different height rounds differently (max
    2.4e-4 in bf16). At 4k keys a 16-row block costs 2.1 ms a layer against 5.7 ms for 9
    separate one-row queries, and a step 2.1 ms against 0.8 ms unmasked.
    """
    batch, heads, query_len, head_dim = query.shape
    first_visible = key.shape[2] - query_len + 1
    outputs = []
    row = 0
    while row < query_len:
        padded = -(-(first_visible + row) // ROW_EXACT_KEY_BUCKET) * ROW_EXACT_KEY_BUCKET
        end = min(query_len, padded - first_visible + 1, row + ROW_EXACT_QUERY_BLOCK)
        block = query.new_zeros((batch, heads, ROW_EXACT_QUERY_BLOCK, head_dim))
        block[:, :, : end - row] = query[:, :, row:end]
        mask = _visible_key_mask(first_visible + row, end - row, padded, query.dtype, query.device)
        attended = F.scaled_dot_product_attention(
            block, _keys_up_to(key, padded), _keys_up_to(value, padded), attn_mask=mask, scale=scaling, enable_gqa=True
        )
        outputs.append(attended[:, :, : end - row])
        row = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


@functools.lru_cache(maxsize=16)  # one forward asks for the same masks in every layer
def _visible_key_mask(
    first_visible: int, rows: int, padded: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[1, 1, block, padded] additive mask: row i < rows sees keys < first_visible + i,
    the unused rows key 0 alone (a row seeing nothing would be NaN)."""
    visible = torch.ones(ROW_EXACT_QUERY_BLOCK, dtype=torch.long, device=device)
    visible[:rows] = torch.arange(first_visible, first_visible + rows, device=device)
    hidden = torch.arange(padded, device=device)[None, :] >= visible[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))[None, None]


def _keys_up_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` [B, H, L, D] cut or extended to ``length`` positions. The extension
    reads the cache buffer's own rows past L (``GrowableLayer`` zeroes new buffers, and
    a rolled-back row is finite), which the mask hides: a hidden key adds exactly 0."""
    have = tensor.shape[2]
    if have >= length:
        return tensor[:, :, :length]
    size = (tensor.shape[0], tensor.shape[1], length, tensor.shape[3])
    strides = tensor.stride()
    last = tensor.storage_offset() + sum((extent - 1) * stride for extent, stride in zip(size, strides, strict=True))
    in_buffer = (
        tensor.stride(3) == 1
        and tensor.stride(2) == tensor.shape[3]
        and tensor.stride(1) >= length * tensor.shape[3]
        and (last + 1) * tensor.element_size() <= tensor.untyped_storage().nbytes()
    )
    if in_buffer:
        return tensor.as_strided(size, tensor.stride())
    padding = tensor.new_zeros((tensor.shape[0], tensor.shape[1], length - have, tensor.shape[3]))
    return torch.cat([tensor, padding], dim=2)


def _sdpa_shared_kv_heads(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with ``enable_gqa`` instead of repeated KV heads; anything unusual goes to stock."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    query_len = query.shape[2]
    if kwargs.get(PACKED_KWARG) is not None:
        output = _attend_packed(module, query, kwargs[PACKED_KWARG], scaling, bool(kwargs.get(ROW_EXACT_KWARG)))
        return output.transpose(1, 2).contiguous(), None
    if kwargs.get(ROW_EXACT_KWARG) and query_len <= ROW_EXACT_MAX_QUERY:
        output = _attend_rows_canonically(module, query, key, value, scaling)
        return output.transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and query_len > 1)
    if causal and key.shape[2] > query_len:  # same convention as transformers' sdpa path
        key, value = key[:, :, :query_len], value[:, :, :query_len]
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        scale=scaling,
        is_causal=causal,
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    return output.transpose(1, 2).contiguous(), None


def attend_prompt_blocks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Causal attention for the last q of L positions, as prompt rows: one call per block
    of positions aligned to ``PREFILL_BLOCK``, over the keys up to that block's end.

    A row's call then depends on its position alone, never on where its prefill chunk
    began or ended, so a prompt prefilled in chunks, or after a prefix-cache hit (hits end
    on block boundaries), gets the bits of a whole prefill. Measured on the AVX512-BF16
    EPYC, 9 heads, 3 KV heads, head dim 64 (one layer): 15.1 ms against 15.0 ms for one
    causal call at 1k positions, 54.9 against 47.3 at 2k, 219 against 159 at 4k.
    """
    query_len, total = query.shape[2], key.shape[2]
    outputs = []
    row = total - query_len
    while row < total:
        end = min(total, (row // PREFILL_BLOCK + 1) * PREFILL_BLOCK)
        hidden = torch.arange(end, device=query.device)[None, :] > torch.arange(row, end, device=query.device)[:, None]
        mask = torch.zeros(hidden.shape, dtype=query.dtype, device=query.device).masked_fill(hidden, float("-inf"))
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, row - total + query_len : end - total + query_len],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=mask[None, None],
                scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1],
            )
        )
        row = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _attend_packed(
    module: torch.nn.Module, query: torch.Tensor, packed: Any, scaling: float | None, row_exact: bool
) -> torch.Tensor:
    """Each chunk's query rows attend to their own sequence's keys (``decoding/packed.py``):
    prompt rows in aligned blocks, other rows by the call a batch-1 forward would make, a
    draft tree's rows path by path in that same call in row-exact mode, else in one call
    with a tree mask (``decoding/tree_attention.py``)."""

    def chain(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return _attend_chain(module, rows, key, value, scaling, row_exact)

    outputs = []
    layer_kv = packed.layer_kv[module.layer_idx]
    for chunk, (start, end), (key, value) in zip(packed.chunks, packed.bounds, layer_kv, strict=True):
        rows = query[:, :, start:end]
        if chunk.prompt:
            outputs.append(attend_prompt_blocks(rows, key, value, scaling))
        elif chunk.tree is not None and row_exact:
            outputs.append(attend_tree(rows, key, value, chunk.tree, chain))
        elif chunk.tree is not None:
            outputs.append(attend_tree_masked(rows, key, value, chunk.tree, scaling))
        else:
            outputs.append(chain(rows, key, value))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _attend_chain(
    module: torch.nn.Module,
    rows: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    row_exact: bool,
) -> torch.Tensor:
    """The last ``rows`` of a sequence attending causally to its keys, as a batch-1 forward does."""
    count = rows.shape[2]
    if row_exact and count <= ROW_EXACT_MAX_QUERY:
        return _attend_rows_canonically(module, rows, key, value, scaling)
    gqa = key.shape[1] != rows.shape[1]
    if count == 1:  # one row sees every key: no mask, the fast kernel
        return F.scaled_dot_product_attention(rows, key, value, scale=scaling, enable_gqa=gqa)
    positions = torch.arange(key.shape[2], device=rows.device)
    hidden = positions[None, :] > positions[key.shape[2] - count :, None]  # row i sees keys up to its own
    mask = torch.zeros(hidden.shape, dtype=rows.dtype, device=rows.device).masked_fill(hidden, float("-inf"))
    return F.scaled_dot_product_attention(rows, key, value, attn_mask=mask[None, None], scale=scaling, enable_gqa=gqa)


AttentionInterface.register(ATTENTION_NAME, _sdpa_shared_kv_heads)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def install_fast_paths(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a model to the paths above. On a GPU the linears keep ``F.linear``'s form
    (``weight_major`` is float32 only, and the row-exact probes decide the rest) and the
    attention is what lets one packed forward carry many sequences: on an H200 a packed
    bf16 step passed the probes where one forward per sequence cost B launches' time
    (``evals/bench/cuda.py``)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION_NAME)
    return model


def uses_specrag_attention(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
