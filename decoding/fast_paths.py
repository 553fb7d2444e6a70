"""CPU fast paths for the forwards speculative decoding makes: few new tokens, long weights.

Measured on this project's AVX2 machine (``python -m evals.bench_forward`` and the numbers
in the README), two things made a verify forward over k = 2..16 tokens cost far more than
a one-token step, although both read the same weights:

1. MKL's GEMM for ``x @ W.T`` with few rows of ``x`` (``F.linear``) is slow: for an
   [8960 x 1536] weight, 4 rows took 17 ms against 5 ms for one row. Computing the same
   product as ``(W @ x.T).T``, the big matrix as the M dimension, took 4.9 ms. Never slower
   for any k measured up to 512, so every ``nn.Linear`` uses it on CPU.
2. transformers' SDPA path repeats the KV heads of grouped-query attention
   (``repeat_kv``: a copy of the whole cache per layer per forward) whenever a mask is
   needed, i.e. for every verify forward. ``enable_gqa=True`` lets the kernel share heads.

Both change only how the same sums are evaluated; all of specrag's paths (plain step,
verify, draft) and the transformers reference in the benchmark run the same model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "specrag_sdpa"


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` computed as ``(W @ x.T).T``: fast when x has few rows (see module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # contiguous: a transposed output would give attention a head dim with stride != 1,
        # which pushes SDPA off its flash kernel onto the slow math path.
        out = torch.mm(self.weight, rows.t()).t().contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


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


AttentionInterface.register(ATTENTION_NAME, _sdpa_shared_kv_heads)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def install_fast_paths(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a CPU model to the fast paths above; a no-op on other devices."""
    if next(model.parameters()).device.type != "cpu":
        return model
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION_NAME)
    return model
