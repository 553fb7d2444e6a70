"""Row-exact mode and dtype "auto": what makes speculation invisible on every CPU.

The probes decide by measurement, so these tests check that they measure the right
thing (a planted break is caught) and that the choices built on them follow both CPU
kinds' outcomes (flags and measurements monkeypatched), whatever machine runs the suite.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from specrag.decoding import batch_invariance, dtype_choice, fast_paths, linears
from specrag.decoding.batch_invariance import enable_row_exact, find_row_exact_chunking, verify_matches_steps
from specrag.decoding.dtype_choice import DtypeCost, auto_cpu_dtype, cached_costs, choose, linear_shapes
from specrag.decoding.linears import SkinnyLinear, even_chunks
from specrag.decoding.model import load_model, resolve_dtype
from tests.conftest import tiny_causal_lm

DTYPES = (torch.bfloat16, torch.float64, torch.float32)


def test_even_chunks_cover_the_range_in_near_equal_parts() -> None:
    assert even_chunks(8960, 4096) == ((0, 2987), (2987, 5974), (5974, 8960))
    assert even_chunks(4864, 4096) == ((0, 2432), (2432, 4864))
    assert even_chunks(100, 4096) == ((0, 100),)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_chunked_product_is_the_same_sum(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    layer = _random_linear(300, 7, dtype, generator, bias=True)
    x = torch.randn(5, 300, generator=generator).to(dtype)
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    layer.k_chunks = even_chunks(300, 128)
    tolerance = 1e-12 if dtype == torch.float64 else 0.1
    assert torch.allclose(layer(x).double(), reference, atol=tolerance)


def test_the_linear_probe_catches_a_row_dependent_product(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _random_linear(64, 16, torch.float64, torch.Generator().manual_seed(1))
    real_product = SkinnyLinear._product

    def planted(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:  # rounds by the row count
        return real_product(self, rows) + 1e-9 * (rows.shape[0] - 1)

    monkeypatch.setattr(SkinnyLinear, "_product", planted)
    assert find_row_exact_chunking(layer) is None and layer.k_chunks == () and layer.min_rows == 1


def _switching_product(monkeypatch: pytest.MonkeyPatch, rows_limit: int) -> list[int]:
    """Plant a kernel that rounds differently past ``rows_limit`` rows (as oneDNN's bf16
    products do past 32 on the AMX Xeon); returns the row count of every product run."""
    counts: list[int] = []

    def planted(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:
        counts.append(rows.shape[0])
        one_by_one = torch.cat([torch.nn.functional.linear(row[None], self.weight) for row in rows])
        return one_by_one + (1e-6 if rows.shape[0] > rows_limit else 0.0)

    monkeypatch.setattr(SkinnyLinear, "_product", planted)
    return counts


def test_more_rows_than_a_block_get_the_bits_of_their_own_products(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _random_linear(16, 8, torch.float64, torch.Generator().manual_seed(2))
    counts = _switching_product(monkeypatch, rows_limit=4)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    alone = torch.cat([layer(x[row : row + 1]) for row in range(11)])
    assert not torch.equal(layer(x), alone)  # the planted switch bites without blocks
    layer.row_block = 4
    counts.clear()
    assert torch.equal(layer(x), alone) and counts == [4, 4, 3]


def test_prompt_rows_go_in_products_of_exactly_the_prompt_block(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _random_linear(16, 8, torch.float64, torch.Generator().manual_seed(4))
    layer.row_block, layer.prompt_block = 4, 8
    counts = _switching_product(monkeypatch, rows_limit=8)
    x = torch.randn(13, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    prompt_rows = linears.PromptRows.of([False, False] + [True] * 10 + [False])  # a step, a prompt chunk, a step
    marked = linears.PROMPT_ROWS.set(prompt_rows)
    try:
        out = layer(x[None])[0]
    finally:
        linears.PROMPT_ROWS.reset(marked)
    assert counts == [8, 8, 3]  # the 10 prompt rows in two products of 8 (zero-padded), then 3 others
    expected = torch.nn.functional.linear(x, layer.weight)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    counts.clear()
    layer.prompt_block = None  # a layer without it (the LM head) takes every row as any row
    marked = linears.PROMPT_ROWS.set(prompt_rows)
    try:
        layer(x)
    finally:
        linears.PROMPT_ROWS.reset(marked)
    assert counts == [4, 4, 4, 1]  # a lone last row is padded to min_rows (1 here)


def test_the_prompt_block_probe_catches_rows_that_depend_on_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _random_linear(16, 8, torch.float64, torch.Generator().manual_seed(6))
    generator = torch.Generator().manual_seed(0)
    assert batch_invariance.prompt_block_is_exact(layer, generator)
    real_product = SkinnyLinear._product

    def planted(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:  # a row sees the others
        return real_product(self, rows) + 1e-9 * rows.sum()

    monkeypatch.setattr(SkinnyLinear, "_product", planted)
    assert not batch_invariance.prompt_block_is_exact(layer, generator)
    setting = batch_invariance.find_row_exact_setting(layer)
    assert setting is None or setting.prompt_block is None


@pytest.mark.parametrize("cached", [3, 30])  # all rows in one key bucket; rows across two
def test_each_verify_row_is_the_one_token_steps_call(cached: int) -> None:
    generator = torch.Generator().manual_seed(0)
    appended, length = 5, cached + 5
    buffer = 1e3 * torch.randn(2, 2, 4 * fast_paths.ROW_EXACT_KEY_BUCKET, 8, generator=generator, dtype=torch.float64)
    key, value = buffer[:1, :, :length], buffer[1:, :, :length]  # views of a cache buffer, stale rows past the end
    query = torch.randn(1, 4, appended, 8, generator=generator, dtype=torch.float64)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    exact = {fast_paths.ROW_EXACT_KWARG: True}
    rows, _ = fast_paths._sdpa_shared_kv_heads(module, query, key, value, None, **exact)
    for row in range(appended):
        visible = cached + row + 1  # the cache before the append, then the new rows up to this one
        step, _ = fast_paths._sdpa_shared_kv_heads(
            module, query[:, :, row : row + 1], key[:, :, :visible], value[:, :, :visible], None, **exact
        )
        assert torch.equal(rows[:, row], step[:, 0])
        # and it is attention over exactly the visible keys: the padding is hidden
        reference = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, row : row + 1], key[:, :, :visible], value[:, :, :visible], enable_gqa=True
        )
        assert torch.allclose(step[:, 0], reference.transpose(1, 2)[:, 0], atol=1e-9)


def test_padding_past_the_cache_is_copied_where_the_buffer_has_no_room() -> None:
    tensor = torch.randn(1, 2, 5, 4)
    padded = fast_paths._keys_up_to(tensor, 32)
    assert padded.shape == (1, 2, 32, 4) and torch.equal(padded[:, :, :5], tensor) and not padded[:, :, 5:].any()
    assert fast_paths._keys_up_to(tensor, 3).shape[2] == 3


def test_the_model_probe_catches_wrong_per_row_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    candidates = (tiny_causal_lm(vocab_size=64, seed=3, hidden_size=128, dtype=dtype) for dtype in DTYPES)
    lm = next((candidate for candidate in candidates if candidate.row_exact), None)
    if lm is None:
        pytest.skip("no dtype's GEMMs are row-exact on this CPU: the planted break would not be the only one")
    assert verify_matches_steps(lm)

    def sees_one_key_too_few(module, query, key, value, scaling):  # type: ignore[no-untyped-def]
        if query.shape[2] == 1:  # one-token steps share this path: break only the verify
            return original(module, query, key, value, scaling)
        return original(module, query, key[:, :, :-1], value[:, :, :-1], scaling)

    original = fast_paths._attend_rows_canonically
    monkeypatch.setattr(fast_paths, "_attend_rows_canonically", sees_one_key_too_few)
    assert not verify_matches_steps(lm)
    lm.row_exact = False
    assert not enable_row_exact(lm) and not lm.row_exact  # a failed probe leaves the model as it was
    assert all(layer.k_chunks == () and layer.min_rows == 1 for layer in _linears(lm.model))


def test_padding_where_both_ways_are_exact_is_a_fixed_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # A timed choice made plain greedy output differ between two loads of the same model.
    lm = tiny_causal_lm(vocab_size=64, seed=3, hidden_size=128, dtype=torch.float64)
    both_exact = batch_invariance.LinearSetting(2, (), padding_optional=True)
    monkeypatch.setattr(batch_invariance, "find_row_exact_setting", lambda layer, few_rows=False: both_exact)
    monkeypatch.setattr(batch_invariance, "_SETTING_BY_SHAPE", {})
    lm.row_exact = False
    batch_invariance.reset_linears(lm.model)
    assert enable_row_exact(lm) == lm.row_exact
    if lm.row_exact:
        assert all(layer.min_rows == 2 for layer in _linears(lm.model))
    assert not hasattr(batch_invariance, "time")  # nothing in row-exact mode is decided by a clock


def test_a_float32_layer_is_row_exact_through_onednn_and_mkl_alone_is_not() -> None:
    """MKL's float32 GEMM rounds a row by the row count (the reason float32 steps were not
    packed; measured on the AVX512-BF16 EPYC and the AMX Xeon); oneDNN's inner product,
    where the probe finds it exact, is tried first."""
    generator = torch.Generator().manual_seed(4)
    layer = _random_linear(1536, 576, torch.float32, generator)
    if dtype_choice.cpu_has_native_bf16():  # where it was measured; unknown on AVX2-only CPUs
        assert not batch_invariance.linear_rows_are_exact(layer, generator)  # the MKL form
    if not linears.onednn_available(layer.weight):
        pytest.skip("this torch has no oneDNN inner product")
    setting = batch_invariance.find_row_exact_setting(layer)
    if setting is None:
        pytest.skip("oneDNN's float32 product is not row-exact on this CPU: float32 steps stay unpacked")
    assert setting.onednn and setting.min_rows == 2 and layer.onednn
    x = torch.randn(33, 1536, generator=generator)
    together = layer(x)
    assert all(torch.equal(layer(x[row : row + 1])[0], together[row]) for row in range(33))
    torch.testing.assert_close(together, x @ layer.weight.T, atol=1e-3, rtol=0)  # the same product (|y| ~ 20)
    batch_invariance.reset_linears(torch.nn.Sequential(layer))
    assert not layer.onednn and layer.min_rows == 1


def test_onednn_packs_the_weight_once_where_that_stays_row_exact() -> None:
    """The reordered weight is tried before oneDNN's per-call reorder (the same product,
    faster on few rows) and kept only by the probe; reset gives its memory back."""
    generator = torch.Generator().manual_seed(5)
    layer = _random_linear(576, 1536, torch.float32, generator, bias=True)
    if not linears.onednn_available(layer.weight):
        pytest.skip("this torch has no oneDNN inner product")
    setting = batch_invariance.find_row_exact_setting(layer)
    if setting is None or not setting.onednn_packed:
        pytest.skip("oneDNN's packed float32 product is not row-exact on this CPU")
    assert layer.packed_weight is not None and layer.onednn
    x = torch.randn(33, 576, generator=generator)
    together = layer(x)
    assert all(torch.equal(layer(x[row : row + 1])[0], together[row]) for row in range(33))
    torch.testing.assert_close(together, x @ layer.weight.T + layer.bias, atol=1e-3, rtol=0)
    assert batch_invariance.linear_kernels(torch.nn.Sequential(layer)) == {"onednn_packed": 1}
    batch_invariance.reset_linears(torch.nn.Sequential(layer))
    assert layer.packed_weight is None and not layer.onednn


def test_a_packed_model_keeps_one_copy_of_each_weight_and_gets_it_back_on_reset() -> None:
    """smollm2 in float32: the packed layers free their plain weights (the tied head keeps
    its own), the logits do not change, and a reset restores every weight bit for bit."""
    lm = load_model("smollm2-135m", dtype="float32", progress=False)
    layers = _linears(lm.model)
    if not any(layer.packed_weight is not None for layer in layers):
        pytest.skip("oneDNN's packed float32 product is not used on this CPU")
    head = lm.model.get_output_embeddings()
    assert head.weight.numel() and head.weight is lm.model.get_input_embeddings().weight
    released = [layer for layer in layers if layer is not head]
    assert released and all(layer.weight.numel() == 0 for layer in released)
    expected = {id(layer): layer.packed_weight.to_dense() for layer in released}
    tokens = list(range(5, 17))
    before = lm.forward(lm.new_kv(), tokens)
    batch_invariance.make_linears_row_exact(lm.model)  # again: the weights come back first
    assert torch.equal(lm.forward(lm.new_kv(), tokens), before)
    batch_invariance.reset_linears(lm.model)
    assert all(layer.packed_weight is None for layer in layers)
    assert all(torch.equal(layer.weight, expected[id(layer)]) for layer in released)


def test_a_packed_kernel_that_rounds_by_the_row_count_falls_back_to_the_reorder_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(6)
    layer = _random_linear(576, 1536, torch.float32, generator)
    if not linears.onednn_available(layer.weight):
        pytest.skip("this torch has no oneDNN inner product")
    product = SkinnyLinear._product

    def packed_rounds_apart_from_17_rows(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:
        out = product(self, rows)
        return out + 1e-6 * out.abs() if self.packed_weight is not None and rows.shape[0] >= 17 else out

    monkeypatch.setattr(SkinnyLinear, "_product", packed_rounds_apart_from_17_rows)
    setting = batch_invariance.find_row_exact_setting(layer)
    if setting is None:
        pytest.skip("oneDNN's float32 product is not row-exact on this CPU")
    assert setting.onednn and not setting.onednn_packed and layer.packed_weight is None


def test_the_packed_probe_catches_sequences_that_see_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = tiny_causal_lm(vocab_size=64, seed=3, hidden_size=128, dtype=torch.float32)
    if not lm.linears_row_exact:
        pytest.skip("float32 linears are not row-exact on this CPU: nothing is packed")
    assert not lm.row_exact and lm.batch_invariant  # float32: packed exactly, attention kept fast
    assert batch_invariance.packed_matches_alone(lm)
    original = fast_paths._attend_packed

    def one_key_too_few_beside_others(module, query, packed, scaling, row_exact):  # type: ignore[no-untyped-def]
        if len(packed.chunks) > 1:
            packed.layer_kv[module.layer_idx] = [
                (k[:, :, :-1], v[:, :, :-1]) for k, v in packed.layer_kv[module.layer_idx]
            ]
        return original(module, query, packed, scaling, row_exact)

    monkeypatch.setattr(fast_paths, "_attend_packed", one_key_too_few_beside_others)
    assert not batch_invariance.packed_matches_alone(lm)
    lm.linears_row_exact = False
    assert not enable_row_exact(lm) and not lm.batch_invariant  # the failed probe leaves it unpacked
    assert all(not layer.onednn and layer.min_rows == 1 for layer in _linears(lm.model))


def test_native_bf16_cpus_get_a_row_exact_smollm2() -> None:
    if not dtype_choice.cpu_has_native_bf16():
        pytest.skip("this CPU has no native bf16: dtype auto is float32 here")
    lm = load_model("smollm2-135m", dtype="bfloat16", progress=False)
    assert lm.row_exact and verify_matches_steps(lm, seed=2)


# -- dtype "auto" -------------------------------------------------------------------------


def _costs(bf16_cycle: float, bf16_exact: bool = True) -> list[DtypeCost]:
    return [DtypeCost("float32", 0.5, 0.5, False), DtypeCost("bfloat16", bf16_cycle / 2, bf16_cycle / 2, bf16_exact)]


def test_choose_takes_the_cheaper_cycle_among_exact_dtypes() -> None:
    assert choose(_costs(0.6)) is torch.bfloat16
    assert choose(_costs(1.4)) is torch.float32
    assert choose(_costs(0.6, bf16_exact=False)) is torch.float32  # faster, but it would change the text


def test_auto_is_float32_without_native_bf16_and_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_choice, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(dtype_choice, "measure", _must_not_measure)
    assert auto_cpu_dtype(_tiny_config()) is torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


def test_auto_follows_the_measurement_with_native_bf16(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    monkeypatch.setattr(dtype_choice, "cpu_has_native_bf16", lambda: True)
    calls = []

    def fake_measure(config: object, dtype: torch.dtype) -> DtypeCost:
        calls.append(dtype)
        return _costs(0.6)[0] if dtype == torch.float32 else _costs(0.6)[1]

    monkeypatch.setattr(dtype_choice, "measure", fake_measure)
    assert auto_cpu_dtype(_tiny_config()) is torch.bfloat16
    assert auto_cpu_dtype(_tiny_config()) is torch.bfloat16
    assert calls == [torch.float32, torch.bfloat16]  # measured once, then read from the cache
    table = json.loads((tmp_path / "dtype_choice.json").read_text())
    assert [entry["dtype"] for entry in next(iter(table.values()))] == ["float32", "bfloat16"]
    assert resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16  # no config: the flag
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


def test_the_real_measurement_runs_on_small_shapes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECRAG_CACHE", str(tmp_path))
    costs = cached_costs(_tiny_config())
    assert [cost.dtype for cost in costs] == ["float32", "bfloat16"]
    assert all(cost.step_seconds > 0 and cost.verify_seconds > 0 for cost in costs)
    assert sum(count for _, _, count in linear_shapes(_tiny_config())) == 7 * 2 + 1


def test_auto_falls_back_to_float32_when_bf16_verification_is_not_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_choice, "auto_cpu_dtype", lambda config: torch.bfloat16)
    monkeypatch.setattr(batch_invariance, "verify_matches_steps", lambda lm, seed=0: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = load_model("smollm2-135m", dtype="auto", progress=False)
    assert lm.dtype == torch.float32 and not lm.row_exact
    assert any("falls back to float32" in str(warning.message) for warning in caught)
    explicit = load_model("smollm2-135m", dtype="bfloat16", progress=False)  # asked for: kept, near-exact
    assert explicit.dtype == torch.bfloat16 and not explicit.row_exact


def _random_linear(
    in_features: int, out_features: int, dtype: torch.dtype, generator: torch.Generator, bias: bool = False
) -> SkinnyLinear:
    layer = torch.nn.utils.skip_init(SkinnyLinear, in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.uniform_(-1, 1, generator=generator)
    return layer


def _must_not_measure(config: object, dtype: torch.dtype) -> DtypeCost:
    raise AssertionError("measured although the CPU has no native bf16")


def _tiny_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )


def _linears(model: torch.nn.Module) -> list[SkinnyLinear]:
    return [module for module in model.modules() if isinstance(module, SkinnyLinear)]


def test_cache_buffers_are_zeroed_and_bucket_aligned_so_padding_is_read_in_place() -> None:
    from specrag.decoding.kv import GrowableLayer

    layer = GrowableLayer()
    states = torch.randn(1, 2, 5, 4)
    layer.update(states, states)
    buffer = layer._key_buffer
    assert buffer.shape[2] % fast_paths.ROW_EXACT_KEY_BUCKET == 0
    assert not buffer[:, :, 5:].any()  # uninitialised memory could hold NaN, which no mask cancels
    padded = fast_paths._keys_up_to(layer.keys, fast_paths.ROW_EXACT_KEY_BUCKET)
    assert padded.data_ptr() == buffer.data_ptr() and torch.equal(padded[:, :, :5], states)


@pytest.mark.parametrize("setting", [{}, {"min_rows": 2}, {"k_chunks": ((0, 1), (1, 2))}])
def test_the_bias_is_rounded_once_with_the_product_as_f_linear_does(setting: dict) -> None:
    # 2^-8 + 2^-16 rounds to 2^-8 in bf16; 1 + 2^-8 is then a tie that rounds to 1.0, while
    # the sum rounded once is 1 + 2^-7. Qwen's large q/k biases made the second rounding
    # change a 1.5B bf16 answer.
    layer = torch.nn.Linear(2, 1).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[2.0**-8, 2.0**-16]]))
        layer.bias.fill_(1.0)
    x = torch.ones(3, 2, dtype=torch.bfloat16)
    assert torch.nn.functional.linear(x, layer.weight, layer.bias).float().flatten().tolist() == [1.0078125] * 3
    layer.__class__ = SkinnyLinear
    for name, value in setting.items():
        setattr(layer, name, value)
    assert layer(x).float().flatten().tolist() == [1.0078125] * 3
    assert layer(x[:1]).float().flatten().tolist() == [1.0078125]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_the_product_form_follows_the_dtype(dtype: torch.dtype, rows: int) -> None:
    # float32: (W @ x.T).T, MKL's fast form for few rows; bf16: F.linear's x @ W.T, oneDNN's
    # fast form (the 1.5B's step matmuls 97 ms against 125 ms on the AVX512-BF16 EPYC).
    generator = torch.Generator().manual_seed(3)
    layer = _random_linear(1536, 1536, dtype, generator, bias=True)
    x = torch.randn(rows, 1536, generator=generator).to(dtype)
    weight_major = torch.addmm(layer.bias.unsqueeze(1), layer.weight, x.t()).t()
    rows_major = torch.nn.functional.linear(x, layer.weight, layer.bias)
    expected = weight_major if dtype == torch.float32 else rows_major
    assert layer.weight_major == (dtype == torch.float32)
    assert torch.equal(layer(x), expected)
    chunked = _random_linear(64, 8, dtype, generator)
    chunked.k_chunks = ((0, 32), (32, 64))
    y = torch.randn(rows, 64, generator=generator).to(dtype)
    parts = [(chunked.weight[:, a:b], y[:, a:b]) for a, b in chunked.k_chunks]
    if dtype == torch.float32:
        sums = [torch.mm(w, part.t()).t() for w, part in parts]
    else:
        sums = [torch.mm(part, w.t()) for w, part in parts]
    assert torch.equal(chunked(y), (sums[0].float() + sums[1].float()).to(dtype))


def test_mkl_blocks_stop_before_the_first_row_count_that_rounds_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block is the most rows before a kernel switch; a switch at 6 rows, a place that
    rounds apart (the fourth row of any product), and a product whose two rows already
    disagree give blocks of 5, 3 and none."""
    layer = _random_linear(64, 16, torch.float64, torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(0)

    def real_product(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:  # row by row: row-exact
        return torch.stack([self.weight @ row for row in rows])

    def switches_at_six(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:
        return real_product(self, rows) + (1e-9 if rows.shape[0] >= 6 else 0.0)

    monkeypatch.setattr(SkinnyLinear, "_product", switches_at_six)
    setting = batch_invariance.mkl_block_setting(layer, generator)
    assert setting is not None and setting.row_block == 5 and setting.activation_major and setting.min_rows == 2

    def fourth_row_apart(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:
        out = real_product(self, rows)
        if rows.shape[0] >= 4:
            out[3] += 1e-9
        return out

    monkeypatch.setattr(SkinnyLinear, "_product", fourth_row_apart)
    setting = batch_invariance.mkl_block_setting(layer, generator)
    assert setting is not None and setting.row_block == 3

    def second_row_apart(self: SkinnyLinear, rows: torch.Tensor) -> torch.Tensor:
        out = real_product(self, rows)
        out[1:] += 1e-9
        return out

    monkeypatch.setattr(SkinnyLinear, "_product", second_row_apart)
    assert batch_invariance.mkl_block_setting(layer, generator) is None


def test_mkl_blocks_are_tried_only_for_few_rows_on_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server (many rows a forward) keeps oneDNN's kernels; few rows try MKL's blocks first,
    on AVX512 CPUs only (the CPU flag monkeypatched: the rule must hold on every machine)."""
    tried: list[SkinnyLinear] = []

    def record(layer: SkinnyLinear, generator: torch.Generator) -> None:
        tried.append(layer)

    monkeypatch.setattr(batch_invariance, "mkl_block_setting", record)
    layer = _random_linear(96, 32, torch.float32, torch.Generator().manual_seed(6))
    for capability, few_rows, expected in [("AVX512", False, 0), ("AVX512", True, 1), ("AVX2", True, 0)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        tried.clear()
        batch_invariance.find_row_exact_setting(layer, few_rows)
        assert len(tried) == expected, (capability, few_rows)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not batch_invariance.mkl_blocks_preferred(layer.weight.to(torch.bfloat16))


def test_onednn_packing_is_tried_on_avx512_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU flag monkeypatched, so the rule holds whatever this machine is."""
    tried: list[bool] = []

    def record(layer: SkinnyLinear, generator: torch.Generator) -> bool:
        tried.append(layer.packed_weight is not None)
        return False

    monkeypatch.setattr(batch_invariance, "linear_rows_are_exact", record)
    monkeypatch.setattr(batch_invariance, "onednn_available", lambda weight: True)
    monkeypatch.setattr(batch_invariance, "pack_for_onednn", lambda weight: weight.clone())
    layer = _random_linear(96, 32, torch.float32, torch.Generator().manual_seed(6))
    for capability, packed_tries in [("AVX512", 2), ("AVX512_BF16", 2), ("AVX2", 0), ("DEFAULT", 0)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        tried.clear()
        assert batch_invariance.find_row_exact_setting(layer) is None
        assert sum(tried) == packed_tries and len(tried) > packed_tries, capability  # then unpacked, chunked
        assert layer.packed_weight is None
    assert not batch_invariance.onednn_packing_preferred(layer.weight.to(torch.bfloat16))


def test_mkl_blocks_give_a_row_its_bits_in_any_product_where_the_probe_finds_them() -> None:
    """The real kernels: where MKL's blocks are exact for a [1536 x 576] layer, a row of a
    product of 40 rows (blocks and a padded remainder) has the bits of the row alone."""
    generator = torch.Generator().manual_seed(7)
    layer = _random_linear(576, 1536, torch.float32, generator)
    setting = batch_invariance.mkl_block_setting(layer, generator)
    if setting is None:
        pytest.skip("MKL's float32 product is not row-exact in blocks on this CPU")
    batch_invariance._apply(layer, setting)
    x = torch.randn(40, 576, generator=generator)
    together = layer(x)
    assert all(torch.equal(layer(x[row : row + 1])[0], together[row]) for row in range(40))
    torch.testing.assert_close(together, x @ layer.weight.T, atol=1e-3, rtol=0)
    assert batch_invariance.linear_kernels(torch.nn.Sequential(layer)) == {"mkl_blocks": 1}
    batch_invariance.reset_linears(torch.nn.Sequential(layer))
    assert not layer.activation_major and batch_invariance.linear_kernels(torch.nn.Sequential(layer)) == {"unexact": 1}
