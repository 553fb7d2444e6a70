"""What a GPU changes: verify and batch costs, and whether packed steps stay exact there.

    python -m specrag.evals.bench.cuda --config ~/.cache/specrag/models/qwen2.5-coder-1.5b/hf

Needs CUDA. Each model is built from its config with random weights on the GPU (costs
depend on shapes, not values; exactness is a property of the kernels), so no weights
travel. For each config it prints:

- **verify cost**: median ms of one sequence's forward over k new tokens after a
  512-token context, through the engine's own cache (``CausalLM.forward``), and k / k=1;
- **batch cost**: B sequences of k new tokens each, as one padded transformers batch
  (the ideal a packed step approaches) and as specrag's packed forward
  (``decoding/packed.py``: one call for the linears, attention per sequence);
- **exactness probes** (``decoding/batch_invariance.py``), in float32 (TF32 off) and in
  bf16: are the linears row-exact under cuBLAS, does a packed forward give each sequence
  its own forward's logits bit for bit, does a verify reproduce one-token steps.

On CUDA the engine runs one forward per sequence unless the packed probe passes, since
packing must change no output (``CausalLM.batch_invariant``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from specrag.decoding.batch_invariance import make_linears_row_exact, packed_matches_alone, verify_matches_steps
from specrag.decoding.engine import Engine
from specrag.decoding.model import CausalLM
from specrag.decoding.packed import Chunk, packed_forward
from specrag.decoding.request import GenerationRequest

VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 4, 16, 64)
BATCH_TOKENS = (1, 4, 8)
ENGINE_BATCHES = (1, 8, 32)
CONTEXT = 512


def _random_model(
    config_dir: str, dtype: torch.dtype, fast_paths: bool, device: torch.device, row_exact: bool = False
) -> CausalLM:
    config = AutoConfig.from_pretrained(config_dir)
    config._attn_implementation = "sdpa"
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return CausalLM(model, name=config_dir, fast_paths=fast_paths, row_exact=row_exact)


def _median_ms(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    for _ in range(2):  # warm-up: kernel selection, allocator
        run()
    timings = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def verify_costs(lm: CausalLM, repeats: int) -> dict[int, float]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, lm.vocab_size, (CONTEXT + max(VERIFY_TOKENS),), generator=generator).tolist()
    kv = lm.new_kv()
    lm.prefill(kv, tokens[:CONTEXT])

    def forward(count: int) -> None:
        lm.forward(kv, tokens[CONTEXT : CONTEXT + count])
        kv.crop(CONTEXT)

    return {count: _median_ms(lambda count=count: forward(count), repeats, lm.device) for count in VERIFY_TOKENS}


@torch.inference_mode()
def padded_batch_ms(lm: CausalLM, batch: int, count: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, lm.vocab_size, (batch, CONTEXT + count), generator=generator).to(lm.device)
    cache = DynamicCache()
    lm.model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True, logits_to_keep=1)

    def forward() -> None:
        lm.model(input_ids=ids[:, CONTEXT:], cache=cache, use_cache=True)
        cache.crop(-count)

    return _median_ms(forward, repeats, lm.device)


@torch.inference_mode()
def packed_batch_ms(lm: CausalLM, batch: int, count: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(2)
    kvs = [lm.new_kv() for _ in range(batch)]
    for kv in kvs:
        lm.prefill(kv, torch.randint(0, lm.vocab_size, (CONTEXT,), generator=generator).tolist())
    appended = [torch.randint(0, lm.vocab_size, (count,), generator=generator).tolist() for _ in kvs]

    def forward() -> None:
        packed_forward(lm, [Chunk(kv, tokens) for kv, tokens in zip(kvs, appended, strict=True)])
        for kv in kvs:
            kv.crop(CONTEXT)

    return _median_ms(forward, repeats, lm.device)


def exactness(config_dir: str, dtype: torch.dtype, device: torch.device) -> dict[str, bool]:
    lm = _random_model(config_dir, dtype, fast_paths=True, device=device)
    linears = make_linears_row_exact(lm.model)
    return {
        "linears row-exact": linears,
        "packed = alone": packed_matches_alone(lm),
        "verify = steps": verify_matches_steps(lm),
    }


def engine_tokens_per_second(lm: CausalLM, batch: int, max_tokens: int) -> float:
    """Aggregate tok/s of one engine serving ``batch`` requests at once (speculation off)."""
    generator = torch.Generator().manual_seed(3)
    engine = Engine(lm)
    for _ in range(batch):
        prompt = torch.randint(0, lm.vocab_size, (64,), generator=generator).tolist()
        engine.add(GenerationRequest(prompt, max_tokens=max_tokens, stop_token_ids=[], speculation="off"))
    _synchronize(lm.device)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(event.token_ids) for event in engine.step())
    _synchronize(lm.device)
    return tokens / (time.perf_counter() - start)


def engine_report(config_dir: str, device: torch.device) -> None:
    """The engine itself, one forward per sequence against packed steps (where the probes pass)."""
    alone = _random_model(config_dir, torch.bfloat16, fast_paths=True, device=device)
    packing = _random_model(config_dir, torch.bfloat16, fast_paths=True, device=device, row_exact=True)
    print(f"\nengine, bf16, 32 new tokens each: packed steps {packing.batch_invariant}, row-exact {packing.row_exact}")
    print("| requests at once | one forward each, tok/s | packed, tok/s | packed / one each |")
    print("| ---: | ---: | ---: | ---: |")
    for batch in ENGINE_BATCHES:
        engine_tokens_per_second(alone, 1, 4)  # warm-up
        one_each = engine_tokens_per_second(alone, batch, 32)
        packed = engine_tokens_per_second(packing, batch, 32)
        print(f"| {batch} | {one_each:.1f} | {packed:.1f} | {packed / one_each:.2f} |")


def report(config_dir: str, repeats: int, device: torch.device) -> None:
    print(f"\n## {config_dir} (random weights, bf16, context {CONTEXT}, median ms)")
    # stock: what the engine runs on CUDA today; packing: specrag attention forced on
    stock = _random_model(config_dir, torch.bfloat16, fast_paths=False, device=device)
    packing = _random_model(config_dir, torch.bfloat16, fast_paths=True, device=device)
    costs = verify_costs(stock, repeats)
    print("| k | " + " | ".join(str(count) for count in VERIFY_TOKENS) + " |")
    print("| --- |" + " ---: |" * len(VERIFY_TOKENS))
    print("| ms | " + " | ".join(f"{costs[count]:.2f}" for count in VERIFY_TOKENS) + " |")
    print("| / k=1 | " + " | ".join(f"{costs[count] / costs[1]:.2f}" for count in VERIFY_TOKENS) + " |")
    print("\n| B × k | padded batch ms | packed ms | packed / padded | padded / (B × one-token step) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for batch in BATCHES:
        for count in BATCH_TOKENS:
            padded = padded_batch_ms(stock, batch, count, repeats)
            packed = packed_batch_ms(packing, batch, count, repeats)
            per_step = padded / (batch * costs[1])
            print(f"| {batch} × {count} | {padded:.2f} | {packed:.2f} | {packed / padded:.2f} | {per_step:.3f} |")
    del stock, packing
    _empty_cache(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype in (torch.float32, torch.bfloat16):
        print(f"exactness {dtype}: {exactness(config_dir, dtype, device)}")
        _empty_cache(device)
    engine_report(config_dir, device)
    _empty_cache(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="a model folder holding config.json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}")
    for config_dir in args.config:
        report(config_dir, args.repeats, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
