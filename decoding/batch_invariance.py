"""Row-exact mode: make a verify forward over k tokens equal k one-token steps, bit for bit.

Greedy speculative output equals plain greedy output only if every verify row gets the
logits the plain path would compute at that position. ``decoding/fast_paths.py`` has the
two mechanisms (K-chunked linears, per-row attention); this module decides, by
measurement on the machine at hand, whether they reach bit-exactness:

1. every distinct linear shape of the model is probed: a product over ``PROBE_ROWS`` rows
   against the same rows one at a time, with the layer's own weight. Unchunked first,
   then with K split into chunks of at most ``CHUNK_LIMITS``; the first exact setting is
   kept. (Native-bf16 CPU: K <= 4096 is exact unchunked; Qwen's MLP down projections,
   K = 4864 and 8960, need chunks. float32 GEMMs are not row-invariant at any K.)
2. where the linears are row-exact, a one-row product may as well run as two copies of
   the row (``SkinnyLinear.min_rows``); that is kept when a one-token forward measures
   faster so (it did on the AMX machine: oneDNN's one-row bf16 kernels are slow there).
3. the whole model is probed: ``VERIFY_TOKENS`` one-token steps after a random context
   against one verify forward over the same tokens, every logit compared bitwise.

Either probe failing leaves the model as it was (``row_exact`` False): the engine is then
exact only up to near-ties, as float32 has always been (``decoding/numerics.py``).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from decoding.fast_paths import SkinnyLinear, even_chunks, uses_specrag_attention

if TYPE_CHECKING:
    from decoding.model import CausalLM

PROBE_ROWS = (2, 3, 17)  # a product over this many rows against its rows one by one
CHUNK_LIMITS = (4096, 2048, 1024)  # largest K per chunk tried, in order
PROBE_CONTEXT = 40  # random context tokens before the model-level probe
VERIFY_TOKENS = 9  # a verify of γ = 8, the policy's usual largest
PADDING_TRIALS = 5  # one-token forwards timed each way, interleaved
PADDING_MIN_GAIN = 0.05  # pad only when the median one-token forward is at least this much faster

_CHUNKING_BY_SHAPE: dict[tuple[int, int, torch.dtype], tuple[tuple[int, int], ...] | None] = {}


def linear_rows_are_exact(layer: SkinnyLinear, generator: torch.Generator) -> bool:
    """Does each row of a many-row product equal that row's one-row product, bitwise?"""
    in_features = layer.weight.shape[1]
    for rows in PROBE_ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(layer.weight.dtype)
        together = layer(x)
        one_by_one = torch.cat([layer(x[row : row + 1]) for row in range(rows)])
        if not torch.equal(together, one_by_one):
            return False
    return True


def find_row_exact_chunking(layer: SkinnyLinear) -> tuple[tuple[int, int], ...] | None:
    """The first K-chunking (none, then ever smaller chunks) that makes ``layer`` row-exact;
    the layer keeps it. None, and no chunks, if none does."""
    generator = torch.Generator().manual_seed(0)
    in_features = layer.weight.shape[1]
    candidates = [()] + [even_chunks(in_features, limit) for limit in CHUNK_LIMITS if in_features > limit]
    for chunks in candidates:
        layer.k_chunks = chunks
        if linear_rows_are_exact(layer, generator):
            return chunks
    layer.k_chunks = ()
    return None


@torch.inference_mode()
def make_linears_row_exact(model: torch.nn.Module) -> bool:
    """Give every SkinnyLinear the K-chunking that makes it row-exact; False if one has none."""
    layers = [module for module in model.modules() if isinstance(module, SkinnyLinear)]
    for layer in layers:
        key = (*layer.weight.shape, layer.weight.dtype)
        if key not in _CHUNKING_BY_SHAPE:  # the kernel's order depends on shape, not values
            _CHUNKING_BY_SHAPE[key] = find_row_exact_chunking(layer)
        chunking = _CHUNKING_BY_SHAPE[key]
        if chunking is None:
            reset_linears(model)
            return False
        layer.k_chunks = chunking
    return bool(layers)


def reset_linears(model: torch.nn.Module) -> None:
    _set_min_rows(model, 1)
    for module in model.modules():
        if isinstance(module, SkinnyLinear):
            module.k_chunks = ()


def _set_min_rows(model: torch.nn.Module, min_rows: int) -> None:
    for module in model.modules():
        if isinstance(module, SkinnyLinear):
            module.min_rows = min_rows


@torch.inference_mode()
def pad_single_rows_if_faster(lm: CausalLM) -> bool:
    """Time one-token forwards with one-row and two-row products; keep the faster."""
    kv = lm.new_kv()
    lm.prefill(kv, [token % lm.vocab_size for token in range(PROBE_CONTEXT)])
    seconds: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(PADDING_TRIALS + 1):  # the first round warms both up
        for min_rows, samples in seconds.items():
            _set_min_rows(lm.model, min_rows)
            start = time.perf_counter()
            lm.forward(kv, [0], last_only=True)
            samples.append(time.perf_counter() - start)
            kv.crop(PROBE_CONTEXT)
    one_row, two_rows = (statistics.median(seconds[rows][1:]) for rows in (1, 2))
    padded = two_rows < (1 - PADDING_MIN_GAIN) * one_row
    _set_min_rows(lm.model, 2 if padded else 1)
    return padded


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


def enable_row_exact(lm: CausalLM) -> bool:
    """Switch ``lm`` to row-exact mode if the probes show it is bit-exact here."""
    if lm.device.type != "cpu" or not uses_specrag_attention(lm.model):
        return False
    if not make_linears_row_exact(lm.model):
        return False
    lm.row_exact = True
    pad_single_rows_if_faster(lm)
    if verify_matches_steps(lm):
        return True
    lm.row_exact = False
    reset_linears(lm.model)
    return False
