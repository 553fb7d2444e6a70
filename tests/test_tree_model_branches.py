"""The draft model's runner-up tokens as tree branches (decoding/drafters/model_drafter.py):
each alternative is the greedy chain up to a position plus the draft's second-best token
there; the engine's greedy output with them equals plain greedy, and they commit tokens."""

from __future__ import annotations

import pytest
import torch

from specrag.decoding.drafters import ModelDrafter
from specrag.decoding.engine import Engine, GenerationRequest
from specrag.decoding.model import CausalLM
from specrag.decoding.policy import PolicyConfig
from specrag.decoding.sampling import SamplingParams
from tests.conftest import tiny_causal_lm
from tests.test_tree_verify import SMALL_POOL, TARGET, VOCAB, run


def noisy_copy(lm: CausalLM, scale: float, seed: int) -> CausalLM:
    """The target with noise on its LM head: a draft whose argmax is often the target's and
    whose runner-up often is where it is not."""
    draft = tiny_causal_lm(VOCAB, seed=5)
    generator = torch.Generator().manual_seed(seed)
    head = draft.model.lm_head.weight
    with torch.no_grad():
        head.add_(scale * head.abs().mean() * torch.randn(head.shape, generator=generator, dtype=head.dtype))
    return draft


DRAFT = noisy_copy(TARGET, 2.0, seed=1)


def tree_engine() -> Engine:
    policy = PolicyConfig(tree_nodes=10)
    return Engine(TARGET, DRAFT, default_drafter="model", debug=True, policy=policy, kv_cache_bytes=SMALL_POOL)


def random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_each_alternative_is_the_chain_to_a_position_plus_the_runner_up_there() -> None:
    prompt = random_prompt(0, 12)
    drafter = ModelDrafter(DRAFT, SamplingParams(temperature=0.0), branches=3)
    draft = drafter.propose(prompt, 5)
    assert len(draft.tokens) == 5 and len(draft.alternatives) == 3
    second_q = []
    for alternative in draft.alternatives:
        position = len(alternative.tokens) - 1
        assert alternative.tokens[:position] == draft.tokens[:position]
        with torch.no_grad():
            logits = DRAFT.model(torch.tensor([[*prompt, *draft.tokens[:position]]])).logits[0, -1]
        top = torch.topk(logits, 2).indices.tolist()
        assert top[0] == draft.tokens[position] and alternative.tokens[position] == top[1]
        second_q.append(float(torch.softmax(logits, -1)[top[1]]))
    assert second_q == sorted(second_q, reverse=True)  # the likeliest runner-ups first


def test_sampled_drafts_and_drafters_without_branches_offer_none() -> None:
    prompt = random_prompt(1, 12)
    assert ModelDrafter(DRAFT, SamplingParams(temperature=0.0)).propose(prompt, 4).alternatives == []
    sampled = ModelDrafter(DRAFT, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), branches=3)
    assert sampled.propose(prompt, 4).alternatives == []


def test_a_branch_taken_keeps_only_the_shared_drafts_in_the_draft_cache() -> None:
    prompt = random_prompt(2, 12)
    drafter = ModelDrafter(DRAFT, SamplingParams(temperature=0.0), branches=4)
    draft = drafter.propose(prompt, 5)
    branch = next(alt for alt in draft.alternatives if len(alt.tokens) >= 3)
    committed = [*branch.tokens, 0]  # the path left the chain at the branch's last token
    drafter.on_commit(committed, len(branch.tokens))
    assert drafter.kv.token_ids == [*prompt, *branch.tokens[:-1]]
    assert drafter.cache_matches([*prompt, *committed])


@pytest.mark.parametrize("seed", range(6))
def test_greedy_with_model_branches_equals_plain_greedy(seed: int) -> None:
    prompt = random_prompt(seed, 16 + 3 * seed)
    options = dict(max_tokens=32, stop_token_ids=[])
    plain, _ = run(Engine(TARGET, kv_cache_bytes=SMALL_POOL), GenerationRequest(prompt, speculation="off", **options))
    trees, _ = run(tree_engine(), GenerationRequest(prompt, speculation="on", num_speculative_tokens=4, **options))
    assert trees == plain


def test_model_branches_are_verified_and_commit_tokens() -> None:
    """Without this, the parity test above could pass on chains alone."""
    tree_cycles = branch_tokens = accepted = 0
    for seed in range(6):
        engine = tree_engine()
        request = GenerationRequest(
            random_prompt(seed, 20), max_tokens=32, speculation="on", num_speculative_tokens=4, stop_token_ids=[]
        )
        _, final = run(engine, request)
        tree_cycles += final.stats.tree_cycles
        branch_tokens += final.stats.branch_accepted_tokens
        accepted += final.stats.accepted_tokens
    assert tree_cycles > 0 and branch_tokens > 0
    assert accepted > branch_tokens  # the chain's argmaxes are taken too
