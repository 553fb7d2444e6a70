"""The decoding benchmark runs end to end in --quick mode. Speed is reported, never asserted."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from specrag.decoding.model import CausalLM
from specrag.evals import workloads
from specrag.evals.bench import decode as bench_decode


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
    versions = workloads.load("rag_branching").passages()  # one document in three versions
    assert "context manager" in versions[0] and "resource manager" in versions[1] and "scope guard" in versions[2]
    repeat = workloads.load("agent_repeat").encode(smollm2.tokenizer, smollm2.config.max_position_embeddings)
    assert len(repeat.earlier) == 5 and repeat.prompt not in repeat.earlier


def test_a_workload_that_edits_what_its_passage_lacks_is_refused() -> None:
    workload = workloads.Workload("broken", "", "?", topics=("with",), versions=((("no such words", "x"),),))
    with pytest.raises(ValueError, match="no such words"):
        workload.passages()


def test_a_tenants_earlier_requests_are_answered_first_under_its_own_tenant(smollm2: CausalLM) -> None:
    """(That drafting from them pays is the engine's test: tests/test_tree_sizing.py.)"""
    from specrag.evals.bench.runs import MethodRunner

    runner = MethodRunner(smollm2, None)
    encoded = workloads.load("agent_repeat").encode(smollm2.tokenizer, 2048)
    plain = runner.run("plain", encoded, 8)
    assert runner.engine.history.tokens_held() == 0  # plain keeps no history
    for method in ("ours_auto", "ours_tree"):
        assert runner.run(method, encoded, 8).output == plain.output
    tenants = runner.engine.history._tenants
    assert len(tenants) == 2 and all(len(history._outputs) == 6 for history in tenants.values())


@pytest.mark.slow
def test_quick_benchmark_writes_json_and_plot(smollm2: CausalLM, tmp_path: Path) -> None:
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["--quick", "--dtype", "float32", "--json", str(json_path), "--plot", str(plot_path)]
    assert bench_decode.main(args) == 0
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
        assert result["target_calls"] >= 1  # transformers' forwards are counted too
    assert plot_path.stat().st_size > 10_000
    assert sum(report["linears"].values()) == 211  # smollm2: 30 layers of 7, and the LM head


def test_a_run_without_a_decode_to_time_has_no_rate_and_never_zero() -> None:
    from specrag.evals.bench.runs import Run, _median_rate

    assert Run([1], [5, 6, 7], seconds=1.5, ttft=0.5).decode_tokens_per_s() == 2.0
    assert Run([1], [5], seconds=1.5, ttft=0.5).decode_tokens_per_s() is None  # one token: no decode
    assert Run([1], [5, 6, 7], seconds=1.0, ttft=1.1).decode_tokens_per_s() is None  # prefill noise > decode
    timed, untimed = Run([1], [5, 6, 7], 1.5, 0.5), Run([1], [5, 6], 1.0, 1.1)
    assert _median_rate([untimed, timed, untimed]) == 2.0 and _median_rate([untimed]) is None


@pytest.mark.slow
def test_the_matrix_samples_when_asked_with_one_seed_per_repeat(smollm2: CausalLM, tmp_path: Path) -> None:
    from specrag.decoding.sampling import SamplingParams
    from specrag.evals.bench.runs import MethodRunner

    json_path = tmp_path / "bench.json"
    args = ["--quick", "--dtype", "float32", "--temperature", "0.8", "--top-p", "0.95", "--json", str(json_path)]
    assert bench_decode.main(args) == 0
    report = json.loads(json_path.read_text())
    assert report["sampling"]["temperature"] == 0.8 and report["sampling"]["top_p"] == 0.95
    assert all(result["identical_to_plain"] is None for result in report["results"])
    # Our methods' draws are fixed by the seed and run past the first token; transformers'
    # sampled answer may end inside its first verified block, which has no decode to time.
    assert all(result["tokens_per_s"] > 0 for result in report["results"] if result["method"] != "hf_prompt_lookup")
    assert all(result["tokens_per_s"] is None or result["tokens_per_s"] > 0 for result in report["results"])
    runner = MethodRunner(smollm2, None, sampling=SamplingParams(temperature=1.0))
    encoded = workloads.load("chat_open").encode(smollm2.tokenizer, 2048)
    for method in ("plain", "ours_lookup"):  # a seed fixes the draw of our methods
        outputs = [runner.run(method, encoded, 12, seed=seed).output for seed in (3, 3, 4)]
        assert outputs[0] == outputs[1] != outputs[2]


@pytest.mark.slow
def test_the_serving_benchmark_replays_one_trace_per_rate_for_every_mode(tmp_path: Path) -> None:
    from specrag.evals.bench import serve as bench_serve

    trace = bench_serve.arrival_trace(4.0, 30.0, ["a", "b"], seed=1)
    assert trace == bench_serve.arrival_trace(4.0, 30.0, ["a", "b"], seed=1)  # the same arrivals per mode
    assert 80 < len(trace) < 160 and all(later > earlier for (earlier, _), (later, _) in itertools.pairwise(trace))
    json_path = tmp_path / "serve.json"
    args = ["--rate", "3", "--duration", "1.5", "--max-tokens", "6", "--mode", "off", "--mode", "tree"]
    mix = ["--mix", "rag_branching", "--mix", "agent_repeat"]
    assert bench_serve.main([*args, *mix, "--dtype", "float32", "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["results"]
    assert [row["speculation"] for row in rows] == ["off", "tree"]
    assert rows[0]["requests"] == rows[1]["requests"] > 0 and all(row["failed"] == 0 for row in rows)
    assert all(row["output_tokens_per_s"] > 0 and row["ttft_p50_s"] <= row["ttft_p99_s"] for row in rows)
    assert rows[0]["draft_acceptance"] is None  # nothing drafted with speculation off
    assert 0 < rows[0]["committed_per_target_call"] <= 1.0  # off: at most one token a call
    assert all(0 <= row["max_kv_cache_usage"] <= 1 for row in rows)


def test_the_serving_benchmark_sends_a_users_earlier_questions_and_asks_for_trees() -> None:
    from specrag.evals.bench import serve as bench_serve

    earlier = bench_serve.earlier_bodies(["rag_quote", "agent_repeat"], 16, "tree", "bench:tree:1")
    assert len(earlier) == len(workloads.load("agent_repeat").earlier_questions) > 0
    assert all(body["user"] == "bench:tree:1" for body in earlier)
    bodies = bench_serve.request_bodies(["rag_quote", "agent_repeat"], 16, "tree", "bench:tree:1")
    assert "user" not in bodies["rag_quote"] and bodies["agent_repeat"]["user"] == "bench:tree:1"
    assert bodies["agent_repeat"]["messages"] not in [body["messages"] for body in earlier]
    assert all(body["speculation"] == "auto" and body["draft_tree_nodes"] > 0 for body in bodies.values())
    chains = bench_serve.request_bodies(["rag_quote"], 16, "auto")["rag_quote"]
    assert chains["speculation"] == "auto" and chains["draft_tree_nodes"] == 0


def test_kernel_table_times_each_float32_kernel_and_names_the_row_counts_that_round_apart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specrag.evals.bench import matmul

    assert matmul.main(["--kernels", "--shape", "64x48", "--repeats", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64x48 |")]
    assert [row.split(" | ")[1] for row in rows] == ["mkl", "onednn", "onednn packed"]
    assert all(len(row.split(" | ")) == 2 + len(matmul.KERNEL_ROWS) + 1 for row in rows)
