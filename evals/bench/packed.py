"""Cost of one engine step over B sequences: B forwards one after another, as
``Engine.step()`` runs today, against one packed forward (``decoding/packed.py``).

    python -m specrag.evals.bench.packed --model smollm2-135m --dtype bfloat16 --dtype float32

For each batch size B and chunk kind (1 token per sequence: plain decode; 9: a γ = 8
verify), median milliseconds of the sequential forwards and of the packed one, over
``--repeats``, alternating within each repeat so machine drift hits both alike. Every
sequence has its own prompt of ``--context`` tokens; the caches are cropped back after
each measurement. The last column is the speed-up of packing. With ``--engine``, also the
aggregate tok/s of ``Engine.step()`` over 1, 4 and 8 greedy requests (64-token prompts,
32 new tokens, speculation off) with ``pack`` on and off; the engine packs only where
the linears are row-exact (``CausalLM.batch_invariant``); elsewhere both columns are the
same path. With ``--paged``, the cost
of paged KV (``decoding/kv_pool.py``) on the batch-1 path: a one-token step over a
growable cache against the same step over pool blocks, consecutive (read as a slice) and
scattered (read by a gather), at several context lengths. With ``--draft MODEL``, the
engine's tok/s when that model drafts for ``--model`` (speculation on) for 1, 4 and 8
requests, packed (the drafters in lockstep) and one by one. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specrag.decoding.kv import SequenceKV
from specrag.decoding.kv_pool import KVPool
from specrag.decoding.model import CausalLM, load_model
from specrag.decoding.packed import Chunk, packed_forward

BATCH_SIZES = (1, 4, 8, 16)
CHUNK_TOKENS = (1, 9)


def _caches(model: CausalLM, count: int, context: int, generator: torch.Generator) -> list[SequenceKV]:
    caches = []
    for _ in range(count):
        kv = model.new_kv()
        model.prefill(kv, torch.randint(100, 5000, (context,), generator=generator).tolist())
        caches.append(kv)
    return caches


def measure(model: CausalLM, context: int, repeats: int) -> list[dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    caches = _caches(model, max(BATCH_SIZES), context, generator)
    rows = []
    for batch in BATCH_SIZES:
        for tokens in CHUNK_TOKENS:
            chunks = [torch.randint(100, 5000, (tokens,), generator=generator).tolist() for _ in range(batch)]
            sequential, packed = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                for kv, chunk in zip(caches, chunks, strict=False):
                    model.forward(kv, chunk)
                sequential.append((time.perf_counter() - start) * 1e3)
                for kv in caches[:batch]:
                    kv.crop(context)
                start = time.perf_counter()
                packed_forward(model, [Chunk(kv, chunk) for kv, chunk in zip(caches, chunks, strict=False)])
                packed.append((time.perf_counter() - start) * 1e3)
                for kv in caches[:batch]:
                    kv.crop(context)
            rows.append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    "sequential_ms": statistics.median(sequential),
                    "packed_ms": statistics.median(packed),
                }
            )
    return rows


def engine_rates(model: CausalLM, batch: int, max_tokens: int, repeats: int) -> dict[bool, float]:
    """Aggregate tok/s of ``Engine.step()`` over ``batch`` greedy requests (speculation off),
    packed and not, alternating; medians over ``repeats``."""
    from specrag.decoding.engine import Engine
    from specrag.decoding.request import GenerationRequest

    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 5000, (64,), generator=generator).tolist() for _ in range(batch)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for pack in (False, True):
            engine = Engine(model, pack=pack)
            for prompt in prompts:
                engine.add(GenerationRequest(prompt, max_tokens=max_tokens, speculation="off", stop_token_ids=[]))
            start, tokens = time.perf_counter(), 0
            while engine.has_unfinished():
                tokens += sum(len(event.token_ids) for event in engine.step())
            rates[pack].append(tokens / (time.perf_counter() - start))
    return {pack: statistics.median(values) for pack, values in rates.items()}


DRAFT_MIX = ("rag_quote", "rag_explain", "code_edit", "chat_open")


def draft_rates(
    target: CausalLM, draft: CausalLM, batch: int, max_tokens: int, repeats: int
) -> dict[bool, tuple[float, float]]:
    """Aggregate tok/s and acceptance of ``Engine.step()`` over ``batch`` greedy requests
    (the workloads of ``DRAFT_MIX`` in turn) that ``draft`` drafts for (speculation on, γ 4),
    packed (one packed draft forward per draft position for all, then one target forward)
    and one by one, alternating; medians over ``repeats``."""
    from specrag.decoding.engine import Engine
    from specrag.decoding.request import GenerationRequest
    from specrag.evals import workloads

    limit = int(getattr(target.config, "max_position_embeddings", 32768))
    encoded = [workloads.load(name).encode(target.tokenizer, limit) for name in DRAFT_MIX]
    rates: dict[bool, list[float]] = {True: [], False: []}
    acceptance: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for pack in (False, True):
            engine = Engine(target, draft, default_drafter="model", pack=pack)
            for index in range(batch):
                prompt = encoded[index % len(encoded)].prompt
                engine.add(GenerationRequest(prompt, max_tokens=max_tokens, speculation="on", num_speculative_tokens=4))
            start, tokens, drafted, accepted = time.perf_counter(), 0, 0, 0
            while engine.has_unfinished():
                for event in engine.step():
                    tokens += len(event.token_ids)
                    if event.stats is not None:
                        drafted += event.stats.drafted_tokens
                        accepted += event.stats.accepted_tokens
            rates[pack].append(tokens / (time.perf_counter() - start))
            acceptance[pack].append(accepted / max(drafted, 1))
    return {pack: (statistics.median(rates[pack]), statistics.median(acceptance[pack])) for pack in rates}


def paged_rows(model: CausalLM, contexts: list[int], repeats: int) -> list[dict[str, float]]:
    """Median ms of a one-token step at each context: growable, paged consecutive, paged scattered."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        pool = KVPool(num_blocks=3 * (context // 32 + 2))
        pool.configure(model.config, model.dtype, model.device)
        prompt = torch.randint(100, 5000, (context,), generator=generator).tolist()
        consecutive, scattered, filler = (SequenceKV(model.config, pool=pool) for _ in range(3))
        model.prefill(consecutive, prompt)
        for start in range(0, context, 32):  # every other block belongs to another sequence
            model.prefill(scattered, prompt[start : start + 32])
            model.prefill(filler, [7] * 32)
        caches = {"growable": model.new_kv(), "consecutive": consecutive, "scattered": scattered}
        model.prefill(caches["growable"], prompt)
        times: dict[str, list[float]] = {name: [] for name in caches}
        for repeat in range(repeats):
            order = list(caches.items())
            for name, kv in order[repeat % len(order) :] + order[: repeat % len(order)]:  # rotate: no order bias
                start = time.perf_counter()
                model.forward(kv, [11], last_only=True)
                times[name].append((time.perf_counter() - start) * 1e3)
                kv.crop(context)
        rows.append({"context": context, **{name: statistics.median(values) for name, values in times.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", action="append", help="repeatable; default: auto")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine", action="store_true", help="also: Engine.step() tok/s, packed and not")
    parser.add_argument("--paged", action="store_true", help="only: a step over paged KV against a growable cache")
    parser.add_argument("--draft", help="only: Engine.step() tok/s with this model drafting, packed and not")
    args = parser.parse_args(argv)
    if args.draft:
        dtype = (args.dtype or ["auto"])[0]
        target = load_model(args.model, dtype=dtype, progress=False)
        draft = load_model(args.draft, dtype=dtype, progress=False)
        print("| target | draft | dtype | requests | tok/s one by one | tok/s packed | speed-up | acceptance |")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for batch in (1, 4, 8):
            rates = draft_rates(target, draft, batch, 32, args.repeats)
            (alone, accepted), (packed, _) = rates[False], rates[True]
            print(
                f"| {args.model} | {args.draft} | {str(target.dtype).removeprefix('torch.')} | {batch} "
                f"| {alone:.1f} | {packed:.1f} | {packed / alone:.2f}x | {accepted:.2f} |",
                flush=True,
            )
        return 0
    if args.paged:
        print("| model | dtype | context | growable (ms) | paged, consecutive (ms) | paged, scattered (ms) |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for dtype in args.dtype or ["auto"]:
            model = load_model(args.model, dtype=dtype, progress=False)
            for row in paged_rows(model, [args.context, 4 * args.context, 8 * args.context], args.repeats):
                print(
                    f"| {args.model} | {str(model.dtype).removeprefix('torch.')} | {row['context']} "
                    f"| {row['growable']:.1f} | {row['consecutive']:.1f} ({row['consecutive'] / row['growable']:.3f}x) "
                    f"| {row['scattered']:.1f} ({row['scattered'] / row['growable']:.3f}x) |",
                    flush=True,
                )
        return 0
    print(f"torch threads {torch.get_num_threads()}, context {args.context}, {args.repeats} repeats (medians)")
    print("| model | dtype | exact | sequences | tokens each | B forwards (ms) | one packed (ms) | speed-up |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in args.dtype or ["auto"]:
        model = load_model(args.model, dtype=dtype, progress=False)
        for row in measure(model, args.context, args.repeats):
            print(
                f"| {args.model} | {str(model.dtype).removeprefix('torch.')} | {model.batch_invariant} "
                f"| {row['batch']} "
                f"| {row['tokens']} | {row['sequential_ms']:.1f} | {row['packed_ms']:.1f} "
                f"| {row['sequential_ms'] / row['packed_ms']:.2f}x |",
                flush=True,
            )
        if args.engine:
            print("| model | dtype | requests | tok/s one by one | tok/s packed | speed-up |")
            print("| --- | --- | ---: | ---: | ---: | ---: |")
            for batch in (1, 4, 8):
                rates = engine_rates(model, batch, 32, max(1, args.repeats // 2))
                print(
                    f"| {args.model} | {str(model.dtype).removeprefix('torch.')} | {batch} | {rates[False]:.1f} "
                    f"| {rates[True]:.1f} | {rates[True] / rates[False]:.2f}x |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
