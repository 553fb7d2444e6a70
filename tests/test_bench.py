"""The decoding benchmark runs end to end in --quick mode. Speed is reported, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding.model import CausalLM
from evals import bench_decode, workloads


def test_every_workload_file_loads_and_builds_a_prompt(smollm2: CausalLM) -> None:
    assert set(workloads.names()) >= {
        "rag_quote",
        "rag_explain",
        "code_edit",
        "tool_call_short",
        "chat_open",
        "rag_quote_long",
    }
    for name in workloads.names():
        workload = workloads.load(name)
        encoded = workload.encode(smollm2.tokenizer, smollm2.config.max_position_embeddings)
        assert 0 < len(encoded.prompt) < smollm2.config.max_position_embeddings - workload.max_tokens
        assert encoded.shown_passages == len(workload.topics) or name == "rag_quote_long"
    long = workloads.load("rag_quote_long").encode(smollm2.tokenizer, smollm2.config.max_position_embeddings)
    assert sum(len(passage) for passage in long.passages) >= 8000 and long.shown_passages < len(long.passages)
    assert "def whats_on_the_telly(penguin=None):" in workloads.load("code_edit").user_text([])


@pytest.mark.slow
def test_quick_benchmark_writes_json_and_plot(smollm2: CausalLM, tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert bench_decode.main(["--quick", "--json", str(json_path), "--plot", str(plot_path)]) == 0
    report = json.loads(json_path.read_text())
    assert set(report) >= {"machine", "model", "results"}
    methods = {result["method"] for result in report["results"]}
    assert methods == {"plain", "ours_lookup", "ours_auto", "hf_prompt_lookup"}
    keys = {
        "workload",
        "method",
        "tokens_per_s",
        "speedup_vs_plain",
        "target_calls",
        "committed_per_call",
        "acceptance_by_position",
        "accepted_len_hist",
        "identical_to_plain",
        "first_divergence",
        "ttft_s",
        "tpot_s",
    }
    for result in report["results"]:
        assert keys <= set(result)
        assert result["identical_to_plain"] is True  # greedy, float32
    assert plot_path.stat().st_size > 10_000
