"""One timed run of one decoding method, and the per-method summary the benchmark reports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specrag.decoding import Engine, GenerationRequest, GenerationStats
from specrag.decoding.grammar import Grammar
from specrag.decoding.model import CausalLM
from specrag.decoding.numerics import find_divergence
from specrag.decoding.policy import PolicyConfig
from specrag.decoding.sampling import SamplingParams
from specrag.evals.workloads import Encoded

METHODS = ("plain", "hf", "hf_prompt_lookup", "hf_assisted", "ours_lookup", "ours_draft", "ours_auto", "ours_tree")
TREE_NODES = 16  # ours_tree: ours_auto growing draft trees of up to this many nodes


@dataclass
class Run:
    prompt: list[int]
    output: list[int]
    seconds: float
    ttft: float  # seconds until the first output token
    stats: GenerationStats | None = None
    forward_calls: int | None = None  # transformers' methods: target forwards, prefill included

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first per second after the method's own prefill and first token.

        For our engine that is the first event (the prefill's token). transformers' assisted
        and prompt-lookup generation stream their first token together with the first
        verified candidates, so for them ``ttft`` is measured by a separate
        ``max_new_tokens=1`` run of the same call. Each method's own prefill is subtracted:
        a prefill of 7k tokens varied by seconds between runs here, more than the decode
        it would otherwise be charged to.

        None where there is no decode to time: an answer of one token, or (transformers'
        methods) a sampled answer that ended within the first verified block, whose decode
        is shorter than the prefill's noise between the two calls. Reporting 0 tok/s there
        would read as a measured stall.
        """
        decode_seconds = self.seconds - self.ttft
        return (len(self.output) - 1) / decode_seconds if len(self.output) > 1 and decode_seconds > 0 else None


@dataclass
class Row:
    workload: str
    method: str
    runs: list[Run] = field(default_factory=list)


class MethodRunner:
    needs_draft = frozenset({"hf_assisted", "ours_draft"})

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None,
        gamma: int = 8,
        draft_gamma: int = 4,
        policy: PolicyConfig | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.target = target
        self.sampling = sampling or SamplingParams()  # greedy unless the matrix samples
        self.draft = draft
        self.gamma = gamma
        self.draft_gamma = draft_gamma
        self.engine = Engine(target, draft, policy=policy)
        self.engine.calibrate()  # before any timing: ours_auto's cost model
        self._tenants = itertools.count()

    def run(self, method: str, encoded: Encoded, max_tokens: int, seed: int = 0) -> Run:
        """One timed run; when sampling, every method of a repeat gets the same ``seed``.

        A workload with earlier prompts is a tenant's sequence of requests: ours answer them
        first, untimed, under a tenant of this run's own, so the timed request may draft
        from their outputs (``decoding/drafters/history.py``); the others have no history."""
        if method.startswith("hf"):
            return self._run_hf(method, encoded.prompt, max_tokens, seed)
        tenant = None
        if encoded.earlier and method != "plain":
            tenant = f"bench:{next(self._tenants)}"
            for prompt in encoded.earlier:
                self._run_ours(method, dataclasses.replace(encoded, prompt=prompt), max_tokens, seed, tenant)
        return self._run_ours(method, encoded, max_tokens, seed, tenant)

    def _run_ours(self, method: str, encoded: Encoded, max_tokens: int, seed: int, tenant: str | None) -> Run:
        speculation, drafter, gamma = {
            "plain": ("off", None, self.gamma),
            "ours_lookup": ("on", "lookup", self.gamma),
            "ours_draft": ("on", "model", self.draft_gamma),
            "ours_auto": ("auto", None, self.gamma),
            "ours_tree": ("auto", None, self.gamma),
        }[method]
        request = GenerationRequest(
            encoded.prompt,
            grammar=self.grammar(encoded.constraint),
            max_tokens=max_tokens,
            speculation=speculation,  # type: ignore[arg-type]
            drafter=drafter,  # type: ignore[arg-type]
            num_speculative_tokens=gamma,
            lookup_sources=encoded.passages,
            lookup_source_names=encoded.passage_names,
            sampling=dataclasses.replace(self.sampling, seed=seed),
            tree_nodes=TREE_NODES if method == "ours_tree" else None,
            tenant=tenant,
        )
        output: list[int] = []
        first_token_at = None
        start = time.perf_counter()
        for event in self.engine.generate(request):
            output += event.token_ids
            first_token_at = first_token_at or time.perf_counter()
            stats = event.stats
        seconds = time.perf_counter() - start
        return Run(encoded.prompt, output, seconds, (first_token_at or start) - start, stats)

    def grammar(self, constraint: dict[str, Any] | None) -> Grammar | None:
        if constraint is None:
            return None
        compiler = self.target.grammar_compiler
        if "json_schema" in constraint:
            return compiler.json_schema(constraint["json_schema"])
        return compiler.tool_calls(constraint["tools"], allow_text=False)

    def _run_hf(self, method: str, prompt: list[int], max_tokens: int, seed: int) -> Run:
        input_ids = torch.tensor([prompt], device=self.target.device)
        eos = sorted(self.target.eos_token_ids())
        extra: dict[str, Any] = {"do_sample": False}
        if not self.sampling.greedy:  # generate() has no generator argument: its own seeded global RNG
            extra = {"do_sample": True, "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
            extra["top_k"] = self.sampling.top_k or None
        if method == "hf_prompt_lookup":
            extra["prompt_lookup_num_tokens"] = 10
        elif method == "hf_assisted":
            assert self.draft is not None
            extra["assistant_model"] = self.draft.model

        forward_calls = 0

        def count_forward(*_: object) -> None:
            nonlocal forward_calls
            forward_calls += 1

        def generate(new_tokens: int) -> tuple[list[int], float]:
            torch.manual_seed(seed)
            start = time.perf_counter()
            with torch.inference_mode():
                output = self.target.model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=new_tokens,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                    **extra,
                )
            return output[0, len(prompt) :].tolist(), time.perf_counter() - start

        _, ttft = generate(1)  # the same call's prefill and first token
        # Counted around the timed call only; a hook costs a Python call per forward.
        hook = self.target.model.register_forward_pre_hook(count_forward)
        try:
            output, seconds = generate(max_tokens)
        finally:
            hook.remove()
        return Run(prompt, output, seconds, ttft, forward_calls=forward_calls)


def machine() -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def position_sums(lists: list[list[int]]) -> list[int]:
    width = max((len(values) for values in lists), default=0)
    return [sum(values[index] for values in lists if index < len(values)) for index in range(width)]


def _speculation_summary(stats: list[GenerationStats]) -> dict[str, Any]:
    if not stats:
        keys = ("target_calls", "committed_per_call", "acceptance_by_position", "accepted_len_hist", "stage_seconds")
        keys += ("target_calls_per_token", "grammar_share", "forced_tokens_accepted", "tree_cycles", "branch_tokens")
        return dict.fromkeys(keys)
    drafted = position_sums([stat.drafted_by_position for stat in stats])
    accepted = position_sums([stat.acceptance_by_position for stat in stats])
    reasons: Counter[str] = Counter()
    for stat in stats:
        reasons.update(stat.speculation_off_reasons)
    return {
        "target_calls": statistics.median(stat.target_calls for stat in stats),
        "committed_per_call": statistics.median(stat.committed_per_call for stat in stats),
        "acceptance_by_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted, strict=True)],
        "accepted_len_hist": position_sums([stat.accepted_len_hist for stat in stats]),
        "speculation_off_reasons": dict(reasons),
        "stage_seconds": {
            stage: round(statistics.median(getattr(stat, f"{stage}_s") for stat in stats), 3)
            for stage in ("prefill", "decode", "draft", "verify", "accept", "grammar", "rollback")
        },
        "target_calls_per_token": statistics.median(
            stat.target_calls / stat.output_tokens for stat in stats if stat.output_tokens
        ),
        # Mask work (fill, apply, advance, roll back) as a share of the time after prefill.
        "grammar_share": statistics.median(stat.grammar_s / _decode_seconds(stat) for stat in stats),
        "forced_tokens_accepted": statistics.median(stat.accepted_by_source.get("grammar", 0) for stat in stats),
        "tree_cycles": statistics.median(stat.tree_cycles for stat in stats),
        "branch_tokens": statistics.median(stat.branch_accepted_tokens for stat in stats),
    }


def _forward_calls(counts: list[int]) -> dict[str, Any]:
    """transformers' target forwards, prefill included, as ``target_calls`` is for ours."""
    return {"target_calls": statistics.median(counts)} if counts else {}


def _decode_seconds(stat: GenerationStats) -> float:
    stages = ("decode", "draft", "verify", "accept", "grammar", "rollback")
    return sum(getattr(stat, f"{stage}_s") for stage in stages) or 1.0


def _median_rate(runs: list[Run]) -> float | None:
    """The median decode rate over the repeats that had a decode to time (None if none had)."""
    rates = [rate for rate in (run.decode_tokens_per_s() for run in runs) if rate is not None]
    return statistics.median(rates) if rates else None


def summarise(rows: list[Row], runner: MethodRunner) -> list[dict[str, Any]]:
    plain = {row.workload: row for row in rows if row.method == "plain"}
    results = []
    for row in rows:
        reference = plain[row.workload].runs[0]
        speed = _median_rate(row.runs)
        plain_speed = _median_rate(plain[row.workload].runs)
        different = next((run for run in row.runs if run.output != reference.output), None)
        divergence = None
        sampled = not runner.sampling.greedy  # sampled outputs differ by design: only the distribution is kept
        if different is not None and not sampled:
            found = find_divergence(runner.target, reference.prompt, reference.output, different.output)
            divergence = {"position": found.position, "plain_top2_gap": found.plain_top2_gap} if found else None
        runs = row.runs
        results.append(
            {
                "workload": row.workload,
                "method": row.method,
                "tokens_per_s": None if speed is None else round(speed, 3),
                "speedup_vs_plain": round(speed / plain_speed, 3) if speed and plain_speed else None,
                "end_to_end_tokens_per_s": round(statistics.median(len(r.output) / r.seconds for r in runs), 3),
                "output_tokens": len(runs[0].output),
                "ttft_s": round(statistics.median(run.ttft for run in runs), 3),
                "tpot_s": round(1 / speed, 4) if speed else None,
                "identical_to_plain": None if sampled else different is None,
                "first_divergence": divergence,
                **_speculation_summary([run.stats for run in runs if run.stats is not None]),
                **_forward_calls([run.forward_calls for run in runs if run.forward_calls is not None]),
            }
        )
    return results


def write_outputs(report: dict[str, Any], json_path: str | None, plot_path: str | None, plot: Any) -> None:
    """A benchmark's JSON report and PNG, where asked for (``plot(path)`` draws the PNG)."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    if plot_path:
        plot(plot_path)
