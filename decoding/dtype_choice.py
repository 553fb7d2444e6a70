"""``dtype="auto"`` on a CPU: the dtype whose speculative decoding is measured faster here.

A CPU flag alone does not say which dtype decodes faster: on the AVX2-only EPYC a bf16
matmul is emulated and 2.5-4x slower than float32, so bf16 is never a candidate there; on
native-bf16 CPUs (AVX512-BF16, AMX) bf16 is usually faster, but by how much differs
between a one-token step and a verify, and between CPUs. So where the CPU has native
bf16, both dtypes are timed on the model's own linear shapes (one decoder layer's
projections times the layer count, plus the LM head; random weights, the engine's fast
paths, so a row-exact one-row product may run as two rows) over 1 row (a plain step) and
``VERIFY_ROWS`` rows (a verify of γ = 8), and the dtype with the lower cost of one of each
wins. bf16 is only a candidate when its linears
can be made row-exact (``decoding/batch_invariance.py``): speculation must never change
the text, and bf16 logits tie too often for near-exact to do. The load then checks the
whole model (``CausalLM.row_exact``) and falls back to float32 if that fails.

The measurement takes a second or two and is cached in ``$SPECRAG_CACHE/dtype_choice.json``
by CPU model, torch version and shapes.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specrag.decoding import packs
from specrag.decoding.batch_invariance import find_row_exact_setting
from specrag.decoding.linears import SkinnyLinear

VERIFY_ROWS = 9
# Bumped whenever SkinnyLinear's product forms change, so a cached timing of the old forms
# is measured again instead of deciding the dtype.
PRODUCT_FORMS = 4  # 3: row-exact float32 through oneDNN; 4: its weights packed once (AVX512)
TIMING_REPEATS = 5
CANDIDATES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class DtypeCost:
    dtype: str
    step_seconds: float  # the model's linears over one row
    verify_seconds: float  # the same over VERIFY_ROWS rows
    row_exact: bool  # its linears can be made row-exact here

    @property
    def cycle_seconds(self) -> float:
        return self.step_seconds + self.verify_seconds


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def choose(costs: list[DtypeCost]) -> torch.dtype:
    """The cheapest plain step + verify among the dtypes whose linears are row-exact or
    float32 (whose exactness is the near-tie rule's, see ``decoding/numerics.py``)."""
    eligible = [cost for cost in costs if cost.row_exact or cost.dtype == "float32"]
    best = min(eligible, key=lambda cost: cost.cycle_seconds)
    return getattr(torch, best.dtype)


def linear_shapes(config: Any) -> list[tuple[int, int, int]]:
    """(out, in, count) of the linear layers of a decoder-only transformer config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    intermediate = config.intermediate_size
    return [
        (heads * head_dim, hidden, layers),  # q
        (kv_heads * head_dim, hidden, 2 * layers),  # k, v
        (hidden, heads * head_dim, layers),  # o
        (intermediate, hidden, 2 * layers),  # gate, up
        (hidden, intermediate, layers),  # down
        (config.vocab_size, hidden, 1),  # LM head
    ]


@torch.inference_mode()
def measure(config: Any, dtype: torch.dtype) -> DtypeCost:
    """Time the config's linear shapes in ``dtype`` over 1 and VERIFY_ROWS rows."""
    generator = torch.Generator().manual_seed(0)
    step = verify = 0.0
    row_exact = True
    for out_features, in_features, count in linear_shapes(config):
        layer = torch.nn.utils.skip_init(SkinnyLinear, in_features, out_features, bias=False, dtype=dtype)
        layer.weight.uniform_(-0.05, 0.05, generator=generator)
        setting = find_row_exact_setting(layer)  # the layer computes as row-exact mode would
        row_exact = row_exact and setting is not None
        timings: dict[int, list[float]] = {1: [], 2: [], VERIFY_ROWS: []}
        inputs = {rows: torch.randn(rows, in_features, generator=generator).to(dtype) for rows in timings}
        for _ in range(TIMING_REPEATS + 1):
            for rows, samples in timings.items():
                start = time.perf_counter()
                layer(inputs[rows])
                samples.append(time.perf_counter() - start)
        medians = {rows: statistics.median(samples[1:]) for rows, samples in timings.items()}
        # a row-exact layer runs one row as two where that is faster (SkinnyLinear.min_rows)
        step += count * (min(medians[1], medians[2]) if setting is not None else medians[1])
        verify += count * medians[VERIFY_ROWS]
    return DtypeCost(str(dtype).removeprefix("torch."), step, verify, row_exact)


def auto_cpu_dtype(config: Any) -> torch.dtype:
    """float32 without native bf16; else the measured choice (cached on disk)."""
    if not cpu_has_native_bf16():
        return torch.float32
    return choose(cached_costs(config))


def cached_costs(config: Any) -> list[DtypeCost]:
    path = packs.cache_root() / "dtype_choice.json"
    machine = f"{cpu_model_name()}|forms {PRODUCT_FORMS}|torch {torch.__version__}|threads {torch.get_num_threads()}"
    key = f"{machine}|{linear_shapes(config)}"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = [asdict(measure(config, dtype)) for dtype in CANDIDATES]
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(table, indent=2))
        temporary.replace(path)
    return [DtypeCost(**entry) for entry in table[key]]
