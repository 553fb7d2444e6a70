"""A draft tree verified in one forward (decoding/tree_attention.py, decoding/packed.py):
each node's row gets the logits a chain over its path gets, the accepted path's KV is kept
in place of the tree's, and the engine's greedy output with trees equals plain greedy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding import fast_paths
from specrag.decoding.drafters import Draft
from specrag.decoding.engine import Engine, GenerationRequest
from specrag.decoding.kv import SequenceKV
from specrag.decoding.kv_pool import KVPool
from specrag.decoding.model import CausalLM
from specrag.decoding.packed import Chunk, packed_forward
from specrag.decoding.policy import CostModel, PolicyConfig
from specrag.decoding.tree import path_to
from specrag.decoding.tree_attention import TreeRows, attend_tree, attend_tree_masked
from tests.conftest import tiny_causal_lm

VOCAB = 24
TARGET = tiny_causal_lm(VOCAB, seed=5)
PROMPT = [3, 17, 5, 22, 9, 11, 4, 8, 1, 19]
# preorder: 0 -> 1 -> 2, 0 -> 3, root -> 4 -> 5, root -> 6
TOKENS = [7, 2, 9, 13, 20, 6, 15]
PARENTS = [-1, 0, 1, 0, -1, 4, -1]
SMALL_POOL = 1 << 20  # the debug checks walk every block of the pool: keep it small


def chain_rows(lm: CausalLM, prompt: list[int], pending: int, path: list[int]) -> torch.Tensor:
    """The logits a chain verify over ``path`` gets after ``prompt`` and ``pending``."""
    kv = lm.new_kv()
    lm.prefill(kv, prompt)
    return lm.forward(kv, [pending, *path])


def test_each_node_row_is_its_paths_chain_row_and_the_kept_path_is_the_chain() -> None:
    kv = TARGET.new_kv()
    TARGET.prefill(kv, PROMPT)
    pending = 12
    rows = packed_forward(TARGET, [Chunk(kv, [pending, *TOKENS], tree=TreeRows.of(PARENTS))])[0]
    for node in range(len(TOKENS)):
        path = [TOKENS[index] for index in path_to(PARENTS, node)]
        want = chain_rows(TARGET, PROMPT, pending, path)[-1]
        torch.testing.assert_close(rows[node + 1], want, atol=1e-12, rtol=0)
    torch.testing.assert_close(rows[0], chain_rows(TARGET, PROMPT, pending, [])[-1], atol=1e-12, rtol=0)
    # keep the path root -> 4 -> 5: the cache is then the one a chain over it leaves
    kv.compact(len(PROMPT), [0, 5, 6])
    assert kv.token_ids == [*PROMPT, pending, 20, 6] and kv.cached_length() == len(kv)
    reference = TARGET.new_kv()
    TARGET.prefill(reference, [*PROMPT, pending, 20, 6])
    torch.testing.assert_close(TARGET.forward(kv, [3]), TARGET.forward(reference, [3]), atol=1e-12, rtol=0)


def test_a_tree_beside_other_sequences_in_a_packed_forward() -> None:
    kv, other, alone = TARGET.new_kv(), TARGET.new_kv(), TARGET.new_kv()
    for cache in (kv, other, alone):
        TARGET.prefill(cache, PROMPT[: 4 + len(cache.token_ids) % 3])
    want_other = TARGET.forward(alone, [5, 6])
    tree_rows, other_rows = packed_forward(
        TARGET, [Chunk(kv, [1, *TOKENS], tree=TreeRows.of(PARENTS)), Chunk(other, [5, 6])]
    )
    torch.testing.assert_close(other_rows, want_other, atol=1e-12, rtol=0)
    path = [TOKENS[index] for index in path_to(PARENTS, 3)]
    torch.testing.assert_close(tree_rows[4], chain_rows(TARGET, PROMPT[:4], 1, path)[-1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("cached", [3, 30])
def test_row_exact_tree_rows_are_the_one_token_steps_bits(cached: int) -> None:
    """The attention alone, on stale buffer rows: a node's row is bit for bit the step at its place."""
    generator = torch.Generator().manual_seed(1)
    appended = len(TOKENS) + 1
    buffer = 1e3 * torch.randn(2, 2, 4 * fast_paths.ROW_EXACT_KEY_BUCKET, 8, generator=generator, dtype=torch.float64)
    key, value = buffer[:1, :, : cached + appended], buffer[1:, :, : cached + appended]
    before = buffer.clone()
    query = torch.randn(1, 4, appended, 8, generator=generator, dtype=torch.float64)
    module = torch.nn.Module()
    module.num_key_value_groups = 2

    def chain(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return fast_paths._attend_chain(module, rows, keys, values, None, row_exact=True)

    out = attend_tree(query, key, value, TreeRows.of(PARENTS), chain)
    assert torch.equal(buffer, before)  # the appended rows are back where the forward wrote them
    for row in range(appended):
        path_rows = [0] + [node + 1 for node in path_to(PARENTS, row - 1)] if row else [0]
        index = torch.tensor([*range(cached), *(cached + r for r in path_rows)])
        step = fast_paths._attend_chain(
            module,
            query[:, :, row : row + 1],
            key.index_select(2, index).contiguous(),
            value.index_select(2, index).contiguous(),
            None,
            row_exact=True,
        )
        assert torch.equal(out[:, :, row], step[:, :, 0])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_one_masked_call_gives_each_row_its_paths_attention(dtype: torch.dtype, tolerance: float) -> None:
    """Outside row-exact mode a tree is attended in one call with a tree mask: each row
    gets, up to rounding, what its path's chain call gives it (and the float64 model's
    rows above match chains to 1e-12 through it)."""
    generator = torch.Generator().manual_seed(2)
    appended = len(TOKENS) + 1
    key = torch.randn(1, 2, 9 + appended, 8, generator=generator, dtype=dtype)
    value = torch.randn(1, 2, 9 + appended, 8, generator=generator, dtype=dtype)
    query = torch.randn(1, 4, appended, 8, generator=generator, dtype=dtype)
    module = torch.nn.Module()
    module.num_key_value_groups = 2

    def chain(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return fast_paths._attend_chain(module, rows, keys, values, None, row_exact=False)

    per_path = attend_tree(query, key.clone(), value.clone(), TreeRows.of(PARENTS), chain)
    masked = attend_tree_masked(query, key, value, TreeRows.of(PARENTS), None)
    torch.testing.assert_close(masked, per_path, atol=tolerance, rtol=0)
    visible = TreeRows.of(PARENTS).visible
    assert visible[5].tolist() == [True, False, False, False, False, True, False, False]  # node 4: root, itself
    assert visible[3].tolist() == [True, True, True, True, False, False, False, False]  # node 2: 0 -> 1 -> 2


def test_row_exact_mode_attends_a_tree_path_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The masked call rounds apart from the one-token steps: row-exact mode never takes it."""
    calls: list[str] = []
    monkeypatch.setattr(fast_paths, "attend_tree", lambda *args: calls.append("paths") or args[0])
    monkeypatch.setattr(fast_paths, "attend_tree_masked", lambda *args: calls.append("mask") or args[0])
    module = torch.nn.Module()
    module.layer_idx = 0
    rows = torch.zeros(1, 4, len(TOKENS) + 1, 8)
    chunk = Chunk(TARGET.new_kv(), [1, *TOKENS], tree=TreeRows.of(PARENTS))
    packed = type("Packed", (), {"layer_kv": [[(rows, rows)]], "chunks": [chunk], "bounds": [(0, rows.shape[2])]})
    for row_exact in (True, False):
        fast_paths._attend_packed(module, rows, packed, None, row_exact)
    assert calls == ["paths", "mask"]


def test_paged_and_growable_caches_keep_the_same_rows() -> None:
    pool = KVPool(block_tokens=4, num_blocks=32)
    pool.configure(TARGET.config, TARGET.dtype, TARGET.device)
    paged, growable = SequenceKV(TARGET.config, pool=pool), TARGET.new_kv()
    for kv in (paged, growable):
        TARGET.prefill(kv, PROMPT)
        packed_forward(TARGET, [Chunk(kv, [12, *TOKENS], tree=TreeRows.of(PARENTS))])
        kv.compact(len(PROMPT), [0, 1, 2, 3])  # root -> 0 -> 1 -> 2: a leading run, a crop
        assert kv.compacts and len(kv) == len(PROMPT) + 4
        packed_forward(TARGET, [Chunk(kv, [4, *TOKENS], tree=TreeRows.of(PARENTS))])
        kv.compact(len(PROMPT) + 4, [0, 7])  # root -> 6
    assert paged.token_ids == growable.token_ids == [*PROMPT, 12, 7, 2, 9, 4, 15]
    assert len(paged.table.blocks) == -(-len(paged) // 4)  # blocks past the kept rows went back
    torch.testing.assert_close(TARGET.forward(paged, [1]), TARGET.forward(growable, [1]), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="increase"):
        growable.compact(len(PROMPT), [2, 1])


def branching_prompt(seed: int, length: int) -> tuple[list[int], list[list[int]]]:
    """Short segments that recur with different continuations, and passages that share
    prefixes and diverge: n-gram lookup finds several matches for the same suffix."""
    generator = torch.Generator().manual_seed(seed)
    stems = [torch.randint(0, VOCAB, (3,), generator=generator).tolist() for _ in range(2)]
    tails = [torch.randint(0, VOCAB, (3,), generator=generator).tolist() for _ in range(4)]
    picks = torch.randint(0, 8, (length // 6 + 1,), generator=generator).tolist()
    prompt = [token for pick in picks for token in stems[pick % 2] + tails[pick // 2]][:length]
    passages = [stems[0] + tails[index] + stems[1] for index in range(4)]
    return prompt, passages


def run(engine: Engine, request: GenerationRequest) -> tuple[list[int], object]:
    events = list(engine.generate(request))
    return [token for event in events for token in event.token_ids], events[-1]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), prompt_len=st.integers(6, 60), max_tokens=st.integers(1, 40))
def test_greedy_with_trees_equals_plain_greedy(seed: int, prompt_len: int, max_tokens: int) -> None:
    prompt, passages = branching_prompt(seed, prompt_len)
    request = dict(max_tokens=max_tokens, stop_token_ids=[], lookup_sources=passages)
    plain, _ = run(Engine(TARGET, kv_cache_bytes=SMALL_POOL), GenerationRequest(prompt, speculation="off", **request))
    engine = Engine(
        TARGET, debug=True, min_ngram=1, max_ngram=3, policy=PolicyConfig(tree_nodes=12), kv_cache_bytes=SMALL_POOL
    )
    trees, final = run(engine, GenerationRequest(prompt, speculation="on", num_speculative_tokens=4, **request))
    assert trees == plain
    stats = final.stats
    assert stats.target_calls == 1 + len(stats.gamma_per_cycle)
    assert stats.accepted_tokens == sum(stats.accepted_by_source.values())


def test_trees_are_verified_and_their_branches_commit_tokens() -> None:
    """Over many branching prompts the engine verifies trees and accepts tokens off the chain
    (without these, the parity test above could pass on chains alone)."""
    tree_cycles = branch_tokens = 0
    for seed in range(12):
        prompt, passages = branching_prompt(seed, 48)
        engine = Engine(
            TARGET, debug=True, min_ngram=1, max_ngram=3, policy=PolicyConfig(tree_nodes=12), kv_cache_bytes=SMALL_POOL
        )
        request = GenerationRequest(
            prompt,
            max_tokens=24,
            speculation="on",
            num_speculative_tokens=4,
            stop_token_ids=[],
            lookup_sources=passages,
        )
        _, final = run(engine, request)
        tree_cycles += final.stats.tree_cycles
        branch_tokens += final.stats.branch_accepted_tokens
    assert tree_cycles > 0 and branch_tokens > 0


@pytest.mark.parametrize("packed", [False, True])
def test_tree_verifies_teach_the_cost_per_path_and_never_the_chain_curve(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    """Packed or alone (``Engine.step`` packs where the model is batch-invariant), a tree
    verify's forward refreshes ``tree_path_seconds``; only chains and plain steps move the
    chain curve."""
    target = tiny_causal_lm(VOCAB, seed=5, dtype=torch.float32) if packed else TARGET
    if target.batch_invariant != packed:
        pytest.skip("float32 linears are not row-exact on this CPU: nothing is packed")
    observed: list[tuple[int, int]] = []
    original = CostModel.observe

    def record(self: CostModel, tokens: int, seconds: float, paths: int = 1) -> None:
        observed.append((tokens, paths))
        original(self, tokens, seconds, paths)

    monkeypatch.setattr(CostModel, "observe", record)
    chain_curve: list[int] = []
    monkeypatch.setattr(CostModel, "observe_forward", lambda self, tokens, seconds: chain_curve.append(tokens))
    tree_cycles = 0
    for seed in range(0, 12, 2):  # two requests at a time: a step packs only several sequences
        cost = CostModel({1: 0.01, 16: 0.02})
        policy = PolicyConfig(tree_nodes=12)
        engine = Engine(target, cost_model=cost, min_ngram=1, max_ngram=3, policy=policy, kv_cache_bytes=SMALL_POOL)
        options = dict(max_tokens=24, speculation="on", num_speculative_tokens=4, stop_token_ids=[])
        for prompt, passages in (branching_prompt(seed, 48), branching_prompt(seed + 1, 40)):
            engine.add(GenerationRequest(prompt, lookup_sources=passages, **options))
        while engine.has_unfinished():
            for event in engine.step():
                if event.finished:
                    tree_cycles += event.stats.tree_cycles
    trees = [tokens for tokens, paths in observed if paths > 1]
    # Packed: one observation per step, whose trees add their paths beyond the first. A tree
    # draft that is a single path is observed as a chain.
    assert tree_cycles > 0 and 0 < len(trees) <= tree_cycles
    assert len(chain_curve) == len(observed) - len(trees)


def test_without_tree_nodes_the_drafts_are_chains() -> None:
    prompt, passages = branching_prompt(3, 48)
    engine = Engine(TARGET, debug=True, min_ngram=1, max_ngram=3, kv_cache_bytes=SMALL_POOL)
    options = dict(max_tokens=24, speculation="on", num_speculative_tokens=4, stop_token_ids=[])
    _, final = run(engine, GenerationRequest(prompt, lookup_sources=passages, **options))
    assert final.stats.tree_cycles == 0 and sum(final.stats.gamma_per_cycle) > 0


def test_a_constrained_request_verifies_the_first_path_only() -> None:
    tree = Draft([7, 2, 13], None, "passage:0", 2, parents=[-1, 0, -1], node_sources=["a", "a", "b"])
    assert tree.first_path().tokens == [7, 2] and tree.first_path().parents is None
    assert tree.truncated(1).tokens == [7]
