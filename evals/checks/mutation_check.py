"""Plant known bugs one at a time and check that the tests catch each of them.

    python -m specrag.evals.checks.mutation_check            # all planted bugs
    python -m specrag.evals.checks.mutation_check --only kv  # those whose name contains "kv"

Each mutation is a textual edit of one product file in a temporary copy of the working
tree; the named tests then run there and must fail. A mutation the tests survive is a
test that cannot fail, and this script exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "greedy_accepts_one_token_too_many",
        "decoding/acceptance.py",
        "accepted_len = int(matches.cumprod(dim=0).sum())",
        "accepted_len = min(int(matches.cumprod(dim=0).sum()) + 1, gamma)",
        ("tests/test_acceptance.py", "tests/test_engine.py::test_greedy_speculation_equals_plain_greedy"),
    ),
    Mutation(
        "target_kv_keeps_a_rejected_token",
        "decoding/cycles.py",
        "seq.kv.compact(kept_before, compaction_rows(accepted_nodes))",
        "seq.kv.compact(kept_before, list(range(min(accepted_len + 2, len(seq.kv) - kept_before))))",
        ("tests/test_kv_rollback.py", "tests/test_engine.py::test_greedy_speculation_equals_plain_greedy"),
    ),
    Mutation(
        "draft_kv_not_rolled_back",
        "decoding/drafters/model_drafter.py",
        "self.kv.crop(self._context_len + min(shared, self._fed_drafts))",
        "pass",
        ("tests/test_kv_rollback.py",),
    ),
    Mutation(
        "residual_not_renormalised_from_p_minus_q",
        "decoding/acceptance.py",
        "residual = (p - q).clamp_min(0.0)",
        "residual = p.clone()",
        ("tests/test_acceptance_distribution.py::test_first_two_committed_tokens_follow_the_target",),
    ),
    Mutation(
        "bonus_token_never_drawn",
        "decoding/acceptance.py",
        "q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, target_probs.shape[-1])], dim=1)",
        "q_padded = torch.cat([draft_probs, draft_probs[:, -1:]], dim=1)",
        ("tests/test_acceptance_distribution.py::test_first_two_committed_tokens_follow_the_target",),
    ),
    Mutation(
        "top_p_drops_the_crossing_token",
        "decoding/sampling.py",
        "keep_sorted = mass_before < top_p",
        "keep_sorted = torch.cumsum(sorted_probs, dim=-1) < top_p",
        ("tests/test_sampling.py",),
    ),
    Mutation(
        "stop_token_not_honoured_inside_a_candidate",
        "decoding/sequence.py",
        "if token in self.stop_ids:",
        "if token in self.stop_ids and token is committed[-1]:",
        ("tests/test_engine.py",),
    ),
    Mutation(
        "checksum_not_checked",
        "decoding/packs.py",
        "if actual != pack.sha256:",
        "if False:",
        ("tests/test_packs.py::test_wrong_checksum_is_a_clear_error_naming_the_pack",),
    ),
    Mutation(
        "lookup_rescans_the_stream_every_step",
        "decoding/drafters/prompt_lookup.py",
        "self._extend(context[len(self._stream) :])",
        "self._stream, self._stream_index = [], {}\n        self._extend(context)",
        ("tests/test_prompt_lookup.py",),
    ),
    Mutation(
        "policy_never_probes_after_backing_off",
        "decoding/policy.py",
        "if estimate.observed == 0 or estimate.declined > self.config.probe_interval:",
        "if estimate.observed == 0:",
        ("tests/test_policy.py", "tests/test_engine_policy.py"),
    ),
    Mutation(
        "gamma_choice_ignores_verify_cost",
        "decoding/policy.py",
        "seconds = gamma * draft_token_seconds + cost.forward_seconds(load.tokens + gamma + 1)",
        "seconds = cost.forward_seconds(load.tokens + 1)",
        ("tests/test_policy.py",),
    ),
    Mutation(
        "unsafe_logits_processor_not_gated",
        "decoding/policy.py",
        "if not self.supported:",
        "if False:",
        ("tests/test_policy.py", "tests/test_engine_policy.py"),
    ),
    Mutation(
        "grammar_matcher_not_rolled_back",
        "decoding/grammar.py",
        "self._matcher.rollback(advanced - accepted_len)",
        "pass",
        ("tests/test_grammar.py",),
    ),
    Mutation(
        "grammar_chain_not_cut_at_the_first_rejected_candidate",
        "decoding/grammar.py",
        "if not self._matcher.accept_token(int(token)):\n                break\n            valid_len += 1",
        "if self._matcher.accept_token(int(token)):\n                valid_len += 1",
        ("tests/test_grammar.py",),
    ),
    Mutation(
        "verify_rows_not_masked",
        "decoding/cycles.py",
        "prepare=row_processor(seq, draft),\n            bitmask=bitmask,",
        "prepare=row_processor(seq, draft),\n            bitmask=None,",
        ("tests/test_grammar.py",),
    ),
    Mutation(
        "step_budget_past_the_knee",
        "decoding/policy.py",
        "return min(tokens for tokens, rate in rates.items() if rate >= fraction * best)",
        "return max(tokens for tokens, rate in rates.items() if rate >= fraction * best)",
        ("tests/test_scheduler.py::test_the_step_budget_is_the_knee_of_the_measured_curve",),
    ),
    Mutation(
        "step_mask_rows_given_to_the_wrong_sequence",
        "decoding/step_driver.py",
        "step_bitmask = torch.cat([needs[index].bitmask for index in masked])",
        "step_bitmask = torch.cat([needs[index].bitmask for index in masked][::-1])",
        ("tests/test_batch_exactness.py",),
    ),
    Mutation(
        "draft_q_not_masked",
        "decoding/sequence.py",
        "processors.append(grammar.draft_processor(len(request.prompt_tokens)))",
        "pass",
        ("tests/test_engine_sampling.py::test_constrained_engine_sampling_matches_the_masked_target",),
    ),
    Mutation(
        "tool_timeout_ignored",
        "tools/execute.py",
        "value = await asyncio.wait_for(running, tool.timeout_s)",
        "value = await running",
        ("tests/test_tools.py",),
    ),
    Mutation(
        "unenforced_schema_keyword_accepted",
        "decoding/schema_support.py",
        "raise UnsupportedSchemaError(keyword, node_path)",
        "pass",
        ("tests/test_grammar.py",),
    ),
    Mutation(
        "near_tie_tolerance_zero",
        "decoding/numerics.py",
        "return 2.0 * math.sqrt(num_layers) * bf16_ulp(top_logit)",
        "return 0.0",
        ("tests/test_parity_smollm2.py::test_bf16_divergences_are_near_ties",),
    ),
    Mutation(
        "prefix_cache_trusts_the_hash_alone",
        "decoding/prefix_cache.py",
        "if entry is None or entry[1] != tuple(token_ids[start : start + self.block_tokens]):",
        "if entry is None:",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "prefix_cache_keys_not_chained",
        "decoding/prefix_cache.py",
        "parent = hashlib.sha256(parent + ids[start : start + self.block_tokens].tobytes()).digest()",
        "parent = hashlib.sha256(ids[start : start + self.block_tokens].tobytes()).digest()",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "prefix_cache_evicts_heads_first",
        "decoding/kv.py",
        "for block in reversed(self.blocks):",
        "for block in self.blocks:",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "kv_writes_into_shared_blocks",
        "decoding/kv.py",
        "if self.pool.is_shared(block):",
        "if False:",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "kv_rollback_leaks_a_block",
        "decoding/kv.py",
        "for block in reversed(dropped):",
        "for block in reversed(dropped[1:]):",
        ("tests/test_kv_pool.py::test_a_thousand_random_requests_leak_no_block_and_own_none_twice",),
    ),
    Mutation(
        "failed_packed_forward_leaves_half_appended_rows",
        "decoding/step_driver.py",
        "                for _, need in round_needs:\n                    need.kv.discard_unrecorded()\n",
        "                pass\n",
        ("tests/test_scheduler.py::test_a_sequence_whose_forward_raises_fails_alone",),
    ),
    Mutation(
        "lockstep_drafts_get_another_sequences_rows",
        "decoding/step_driver.py",
        "        for (index, _), answer in zip(round_needs, answers, strict=True):",
        "        for (index, _), answer in zip(round_needs, answers[::-1] if draft else answers, strict=True):",
        ("tests/test_packed.py::test_model_drafters_draft_in_lockstep_and_change_no_output",),
    ),
    Mutation(
        "kv_admission_promises_too_few_blocks",
        "decoding/kv_manager.py",
        "return -(-(len(request.prompt_tokens) + request.max_tokens) // self.pool.block_tokens)",
        "return -(-(len(request.prompt_tokens) + request.max_tokens - 2) // self.pool.block_tokens)",
        ("tests/test_kv_pool.py::test_a_thousand_random_requests_leak_no_block_and_own_none_twice",),
    ),
    Mutation(
        "prefix_cache_serves_the_whole_prompt",
        "decoding/prefix_cache.py",
        "blocks = cache.lookup(token_ids[:-1])",
        "blocks = cache.lookup(token_ids)",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "groundedness_ignores_numbers",
        "agent/grounding/scorer.py",
        "            rules.number_problem(sentence, aligned, passages)\n            or rules.name_problem",
        "            None\n            or rules.name_problem",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "groundedness_ignores_code_names",
        "agent/grounding/scorer.py",
        "or rules.name_problem(sentence, aligned, passages)",
        "or None",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "groundedness_ignores_negation",
        "agent/grounding/scorer.py",
        "or tm.negation_conflict(sentence, aligned, [s for p in passages for s in p.sentences])",
        "or None",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "groundedness_paraphrase_skips_clause_check",
        "agent/grounding/scorer.py",
        "        if clause:\n",
        "        if False:\n",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "citation_precision_counts_every_citation",
        "agent/grounding/scorer.py",
        "precise += _citation_supports(scorer, sentence.text, label, valid, prepared)",
        "precise += 1",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "answerability_uses_p_yes",
        "agent/answerability.py",
        "return float(torch.sigmoid(log_no - log_yes))",
        "return float(torch.sigmoid(log_yes - log_no))",
        ("tests/test_answerability.py",),
    ),
    Mutation(
        "answerability_gate_never_abstains",
        "agent/loop_probes.py",
        '"abstained": threshold is not None and probability >= threshold,',
        '"abstained": False,',
        ("tests/test_answerability.py",),
    ),
    Mutation(
        "abstention_threshold_ties_refuse_more",
        "evals/groundedness/abstention.py",
        "        if j > best_j:",
        "        if j >= best_j:",
        ("tests/test_abstention_sweep.py",),
    ),
    Mutation(
        "citation_after_full_stop_split_off",
        "agent/grounding/text_match.py",
        r"""\s+(?!\[P\d+\])(?=""",
        r"""\s+(?=""",
        ("tests/test_text_match.py",),
    ),
    Mutation(
        "scorer_ignores_a_verbatim_copy",
        "agent/grounding/scorer.py",
        "verbatim = rules.verbatim_passage(sentence, passages)",
        "verbatim = None",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "scorer_judges_only_against_the_best_overlapping_passage",
        "agent/grounding/scorer.py",
        "if verdict.supported or len(passages) < 2:",
        "if True:",
        ("tests/test_groundedness.py",),
    ),
    Mutation(
        "attribution_cites_below_the_threshold",
        "agent/attribution.py",
        "label = passages[closest].label if scores[closest] >= min_similarity else None",
        "label = passages[closest].label",
        ("tests/test_attribution.py",),
    ),
    Mutation(
        "attribution_keeps_the_model_markers",
        "agent/attribution.py",
        "pieces += [answer[cursor:start], with_marker(answer[start:end], label)]",
        "pieces += [answer[cursor:start], answer[start:end] if label is None else with_marker(answer[start:end], label)]",  # noqa: E501
        ("tests/test_attribution.py",),
    ),
    Mutation(
        "nli_reads_the_claim_as_premise",
        "evals/groundedness/nli.py",
        "pairs = [(premise, hypothesis) for premise in premises]",
        "pairs = [(hypothesis, premise) for premise in premises]",
        ("tests/test_nli.py",),
    ),
    Mutation(
        "nli_supports_below_min_entailment",
        "agent/grounding/scorer.py",
        "if probabilities[best] >= self.settings.min_entailment:",
        "if probabilities[best] >= 0.0:",
        ("tests/test_nli.py",),
    ),
    Mutation(
        "report_records_no_default_citation_threshold",
        "evals/groundedness/run.py",
        "    return DEFAULT_MIN_SIMILARITY\n",
        "    return None\n",
        ("tests/test_eval_run.py::test_the_report_records_the_threshold_used_even_when_it_was_the_default",),
    ),
    Mutation(
        "tree_kv_cropped_instead_of_compacted",
        "decoding/kv.py",
        "if list(rows) == list(range(len(rows))):",
        "if True:",
        ("tests/test_tree_verify.py",),
    ),
    Mutation(
        "tree_node_attends_to_its_preorder_neighbours",
        "decoding/tree_attention.py",
        "if order != list(range(width)):",
        "if False:",
        ("tests/test_tree_verify.py",),
    ),
    Mutation(
        "tree_branch_never_rejected_by_a_taken_sibling",
        "decoding/tree_sizing.py",
        "if key and (parents[node] == -1 or parents[node] in accepted):",
        "if key and (parents[node] == -1 or parents[node] in accepted) and node in accepted:",
        ("tests/test_tree_sizing.py",),
    ),
    Mutation(
        "grammar_tree_siblings_share_one_matcher",
        "decoding/grammar.py",
        "            fork = base.fork()\n",
        "            fork = base if parent < 0 else base.fork()\n",
        ("tests/test_grammar_tree.py",),
    ),
    Mutation(
        "tree_paths_cost_nothing",
        "decoding/tree_sizing.py",
        "            paths += 1  # a second child starts a path; a first one extends its parent's\n",
        "            pass\n",
        ("tests/test_tree_sizing.py",),
    ),
    Mutation(
        "model_drafter_keeps_drafts_off_the_accepted_path",
        "decoding/drafters/model_drafter.py",
        "        self.kv.crop(self._context_len + min(shared, self._fed_drafts))\n",
        "        self.kv.crop(self._context_len + min(accepted_len, self._fed_drafts))\n",
        ("tests/test_tree_model_branches.py",),
    ),
    Mutation(
        "ray_routing_text_ignores_the_conversation",
        "agent/asgi_forward.py",
        'return head + "".join(_message_text(message) for message in messages if _role(message) == "user")',
        "return head",
        ("tests/test_asgi_forward.py",),
    ),
    Mutation(
        "replica_death_is_not_retryable",
        "agent/ray_serve.py",
        "_RETRYABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)",
        "_RETRYABLE = (BackPressureError,)",
        ("tests/test_ray_serve.py::test_a_replica_killed_under_load_loses_no_request_silently",),
    ),
    Mutation(
        "ray_metrics_answer_for_one_replica",
        "agent/ray_serve.py",
        'if start.status == 200 and request.method == "GET" and path.rstrip("/") == METRICS_PATH:',
        "if False:",
        ("tests/test_ray_serve.py::test_metrics_through_the_proxy_cover_every_replica",),
    ),
    Mutation(
        "stream_copy_stops_at_its_end",
        "decoding/drafters/prompt_lookup.py",
        "overlapping=sequence is self._stream)",
        "overlapping=False)",
        ("tests/test_prompt_lookup.py",),
    ),
    Mutation(
        "lookup_ignores_how_far_back_a_match_goes",
        "decoding/drafters/prompt_lookup.py",
        "found.sort(key=lambda one: -one[0])",
        "found.sort(key=lambda one: 0)",
        ("tests/test_prompt_lookup.py",),
    ),
    Mutation(
        "planner_never_weighs_a_drafts_rivals",
        "decoding/cycle_plan.py",
        "for candidate in (draft, *draft.rivals):",
        "for candidate in (draft,):",
        ("tests/test_engine_policy.py::test_a_rejected_history_gives_way_to_the_lookup_chain_it_displaced",),
    ),
    Mutation(
        "tree_mask_hides_a_rows_ancestors",
        "decoding/tree_attention.py",
        "seen[row, segment.ancestor_rows] = True",
        "seen[row, segment.ancestor_rows[:1]] = True",
        ("tests/test_tree_verify.py",),
    ),
    Mutation(
        "tree_peers_ignore_how_far_back_they_match",
        "decoding/tree_sizing.py",
        "alternative.match_back >= chain.match_back",
        "True",
        ("tests/test_tree_sizing.py::test_only_a_match_as_long_and_as_far_back_is_a_peer_that_splits_the_chains_vote",),
    ),
    Mutation(
        "tree_peers_never_learn_their_own_estimate",
        "decoding/tree_sizing.py",
        "if vote is not None and not _measured(branch, depth):",
        "if vote is not None:",
        ("tests/test_tree_sizing.py::test_a_branch_that_keeps_failing_stops_being_grown",),
    ),
    Mutation(
        "changed_calls_take_values_from_error_messages",
        "agent/call_rules.py",
        "(result.content for result in executed.values() if result.ok)",
        "(result.content for result in executed.values())",
        ("tests/test_repeat_deviation.py::test_an_error_message_is_no_value_a_changed_call_may_take",),
    ),
    Mutation(
        "cut_words_pour_into_the_first_letter",
        "decoding/cut_words.py",
        "and text[:-1] in ids:\n            table[token_id] = ids[text[:-1]]",
        "and text[:1] in ids:\n            table[token_id] = ids[text[:1]]",
        ("tests/test_cut_words.py::test_each_word_token_points_at_the_same_word_less_its_last_letter",),
    ),
    Mutation(
        "step_rows_skip_cut_words",
        "decoding/step_driver.py",
        "table = needs[index].word_prefixes",
        "table = None",
        ("tests/test_cut_words.py::test_an_enum_value_cut_short_becomes_the_value_the_model_began",),
    ),
    Mutation(
        "row_exact_trees_take_the_masked_call",
        "decoding/fast_paths.py",
        "elif chunk.tree is not None and row_exact:",
        "elif chunk.tree is not None and False:",
        ("tests/test_tree_verify.py::test_row_exact_mode_attends_a_tree_path_by_path",),
    ),
    Mutation(
        "retriever_never_follows_a_rebuild",
        "retrieval/retriever.py",
        "if self.follow and time.monotonic() - self._checked_at >= FOLLOW_INTERVAL_S:",
        "if False:",
        ("tests/test_retrieval_search.py::test_a_retriever_follows_a_rebuild_of_its_directory",),
    ),
    Mutation(
        "shared_traces_are_not_read",
        "agent/trace_store.py",
        "return self.shared.read(trace_id) if self.shared is not None else None",
        "return None",
        ("tests/test_trace.py",),
    ),
    Mutation(
        "remote_tool_results_lose_their_call",
        "agent/remote.py",
        '"tool_call_id": pending.pop(0) if pending else ""',
        '"tool_call_id": ""',
        ("tests/test_remote_engine.py",),
    ),
    Mutation(
        "mkl_block_probe_checks_the_first_row_only",
        "decoding/batch_invariance.py",
        "while block < ROW_BLOCK and torch.equal(layer._product(x[: block + 1]), alone[: block + 1]):",
        "while block < ROW_BLOCK and torch.equal(layer._product(x[: block + 1])[:1], alone[:1]):",
        ("tests/test_batch_invariance.py",),
    ),
    Mutation(
        "mkl_blocks_for_a_server",
        "decoding/batch_invariance.py",
        "    if few_rows and mkl_blocks_preferred(layer.weight):",
        "    if mkl_blocks_preferred(layer.weight):",
        ("tests/test_batch_invariance.py",),
    ),
    Mutation(
        "packed_trees_feed_the_chain_curve",
        "decoding/engine.py",
        "self.cost_model.observe(batch.packed_tokens, batch.packed_seconds, batch.packed_paths)",
        "self.cost_model.observe(batch.packed_tokens, batch.packed_seconds)",
        ("tests/test_tree_verify.py",),
    ),
    Mutation(
        "packed_onednn_weight_trusted_unprobed",
        "decoding/batch_invariance.py",
        "            exact[min_rows] = linear_rows_are_exact(layer, generator)",
        "            exact[min_rows] = packed or linear_rows_are_exact(layer, generator)",
        ("tests/test_batch_invariance.py",),
    ),
    Mutation(
        "released_weight_not_restored_on_unpack",
        "decoding/batch_invariance.py",
        "    if layer.weight.numel() == 0:  # released by release_dense_weights",
        "    if False:  # released by release_dense_weights",
        ("tests/test_batch_invariance.py",),
    ),
    Mutation(
        "packed_onednn_copy_kept_after_reset",
        "decoding/batch_invariance.py",
        "        layer.weight.data = layer.packed_weight.to_dense()\n    layer.packed_weight = None",
        "        layer.weight.data = layer.packed_weight.to_dense()",
        ("tests/test_batch_invariance.py",),
    ),
)


def link_namespace(workdir: Path) -> None:
    """The copy's layers as ``specrag.*``: a ``specrag/`` folder of links, found through
    PYTHONPATH before the editable install's finder (which maps the original tree)."""
    namespace = workdir / "specrag"
    namespace.mkdir()
    for layer in ("agent", "decoding", "retrieval", "tools", "evals"):
        (namespace / layer).symlink_to(workdir / layer, target_is_directory=True)


def run_mutation(mutation: Mutation, workdir: Path) -> bool:
    """Return True when the tests catch the planted bug (pytest fails)."""
    target = workdir / mutation.path
    source = target.read_text()
    if source.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: the text to mutate is not found exactly once in {mutation.path}")
    target.write_text(source.replace(mutation.old, mutation.new))
    try:
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
        # The copy must shadow the editable install of the original tree.
        env = {**os.environ, "PYTHONPATH": str(workdir)}
        result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, check=False)
    finally:
        target.write_text(source)
    return result.returncode == 1  # 1: tests failed; anything else is a collection or usage error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the mutations whose name contains this")
    args = parser.parse_args(argv)
    selected = [mutation for mutation in MUTATIONS if args.only in mutation.name]
    survived = []
    with tempfile.TemporaryDirectory(prefix="specrag-mutants-") as temp:
        workdir = Path(temp) / "tree"
        ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis")
        shutil.copytree(ROOT, workdir, ignore=ignore)
        link_namespace(workdir)
        for mutation in selected:
            caught = run_mutation(mutation, workdir)
            print(f"{'caught  ' if caught else 'SURVIVED'} {mutation.name}  ({', '.join(mutation.tests)})", flush=True)
            if not caught:
                survived.append(mutation.name)
    print(f"{len(selected) - len(survived)}/{len(selected)} planted bugs caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
