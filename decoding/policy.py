"""How many tokens to draft this cycle, or why not to draft at all.

``off`` never drafts; ``on`` verifies every proposal up to a fixed γ; ``auto`` chooses γ
per cycle to maximise expected committed tokens per second,

    rate(γ) = E[committed](γ) / (T_draft(γ) + T_verify(γ + 1)),   rate(0) = 1 / T_verify(1),

with E[committed](γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j from per-position acceptance estimates a_j
(EWMA, per request and per drafter source) and T from a cost model measured at start-up
and refreshed by every forward the engine runs. Choosing γ = 0 is the low-acceptance gate;
it recovers by probing again after ``probe_interval`` declined cycles, so a request that
turns copy-heavy regains speculation.

Estimates are kept per source and, for prompt lookup, per length of the matched n-gram
(1, 2-3, 4 and more): a proposal that continues a long match can be accepted far more often
than one after a 1-gram match, and pooled, the poor ones set the estimate the good ones
are judged by (qwen2.5-coder-1.5b, bf16 EPYC, the decode benchmark: code_edit decoded at
1.08x plain, 63 cycles declined for low acceptance over three runs that followed
chat_open, where transformers' prompt lookup reached 2.2x).
Estimates carry across requests (``shared``), but a request verifies its first proposal
of each kind even when the carried estimate would decline it: that estimate was measured
on other requests, and without one own observation a request could never learn otherwise.

Gates that never draft, each with its reason: ``off``, ``max_tokens``, ``short_output``,
``batch_saturated``, ``unsupported``, ``low_acceptance`` and (from the engine) ``no_proposal``.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Speculation = Literal["auto", "on", "off"]
SPECULATION_MODES: tuple[str, ...] = ("auto", "on", "off")

OFF_BY_REQUEST = "off"
NEAR_MAX_TOKENS = "max_tokens"  # one token left: a verify could commit no more than a plain step
SHORT_OUTPUT = "short_output"  # too few tokens to pay back the drafter's set-up (e.g. its prefill)
BATCH_SATURATED = "batch_saturated"  # enough sequences share the target already
UNSUPPORTED = "unsupported"  # e.g. a logits processor that cannot be applied to q
LOW_ACCEPTANCE = "low_acceptance"  # the measured acceptance makes a plain step faster
NO_PROPOSAL = "no_proposal"  # the drafter had nothing to offer
GRAMMAR_REJECTED = "grammar_rejected"  # the grammar rejected the first candidate

# 64: a packed step's forward carries several sequences' tokens, and a verify's marginal
# cost there is read from this curve beyond 16 (StepLoad).
FORWARD_TOKEN_COUNTS = (1, 2, 4, 8, 16, 64)
TREE_CALIBRATION = (16, 4)  # rows and paths of the tree forward whose extra cost per path is measured
# Prompt-chunk forwards (last row's logits only) timed for the step's token budget.
BUDGET_TOKEN_COUNTS = (128, 256, 512)
# The budget is the fewest tokens per step whose forward reaches this share of the best
# tokens/second measured: past it, a bigger step buys under 10% more throughput and makes
# every running sequence wait its whole length for the next token.
BUDGET_THROUGHPUT_FRACTION = 0.9
BRANCH_SOURCE = "branch"  # a draft tree's branches, judged apart from the chain (decoding/tree_sizing.py)
# Estimates are kept per kind of source; every source not named here is a passage.
PEER_KEY = f"{BRANCH_SOURCE}@peer"  # a branch that matched as long and as far back as the chain
SOURCE_KINDS = frozenset({"output", "prompt", "model", "grammar", "history", BRANCH_SOURCE})


class CostModel:
    """Seconds of one target forward over k new tokens, and of one draft token.

    Seeded by a measurement and refreshed by every forward the engine runs (EWMA per k),
    so it follows the context length and the machine's load. Between measured k the cost
    is interpolated linearly; beyond the largest, extrapolated from the last two points.

    A draft tree's forward can cost more than a chain's over as many rows: in row-exact
    mode its attention runs once per root-to-leaf path (``decoding/tree_attention.py``;
    elsewhere one masked call, and the measured cost is near 0). ``tree_path_seconds`` is
    that extra cost per path beyond the first, measured and refreshed by tree verifies
    apart from the chain curve, so trees never make chains look dearer.
    """

    def __init__(
        self,
        forward_seconds: dict[int, float],
        draft_token_seconds: float = 0.0,
        draft_prefill_token_seconds: float = 0.0,
        decay: float = 0.2,
        prompt_seconds: dict[int, float] | None = None,
        tree_path_seconds: float = 0.0,
    ) -> None:
        if 1 not in forward_seconds:
            raise ValueError("the cost model needs the cost of a one-token forward")
        self._forward = dict(forward_seconds)
        self.draft_token_seconds = draft_token_seconds
        self.draft_prefill_token_seconds = draft_prefill_token_seconds
        self.decay = decay
        self.prompt_seconds = dict(prompt_seconds or {})  # prompt-chunk forwards over T tokens
        self.tree_path_seconds = tree_path_seconds

    @classmethod
    def measure(
        cls,
        forward: Callable[[int], float],
        draft_forward: Callable[[int], float] | None = None,
        counts: tuple[int, ...] = FORWARD_TOKEN_COUNTS,
        repeats: int = 2,
        prompt_seconds: dict[int, float] | None = None,
        tree_forward: Callable[[int, int], float] | None = None,
    ) -> CostModel:
        """``forward(k)`` / ``draft_forward(k)`` run one forward over k tokens and return
        seconds; ``prompt_seconds`` are prompt chunks' costs measured elsewhere
        (``forward_timer.prompt_costs``); ``tree_forward(k, paths)`` verifies a tree of k
        rows in ``paths`` paths (None: the target verifies no trees)."""
        forward(1)  # warm-up: first calls allocate
        seconds = {count: min(forward(count) for _ in range(repeats)) for count in counts}
        draft_token = draft_prefill = 0.0
        if draft_forward is not None:
            draft_forward(1)
            draft_token = min(draft_forward(1) for _ in range(repeats))
            draft_prefill = min(draft_forward(64) for _ in range(repeats)) / 64
        path = 0.0
        if tree_forward is not None:
            rows, paths = TREE_CALIBRATION
            tree = min(tree_forward(rows, paths) for _ in range(repeats))
            path = max(0.0, (tree - min(forward(rows) for _ in range(repeats))) / (paths - 1))
        return cls(seconds, draft_token, draft_prefill, prompt_seconds=prompt_seconds, tree_path_seconds=path)

    def budget_tokens(self, chunk_tokens: int) -> int | None:
        """The step token budget this curve suggests, if prompt chunks were timed: the knee
        (``step_budget``, at least one chunk) for decode and verify tokens, plus the chunk
        the oldest waiting prompt always gets. Measured on the AVX512-BF16 EPYC the knee was
        256 tokens for smollm2 and the 0.5B (a bigger forward bought under 10% more tok/s),
        which gives the 512 the serving benchmarks ran with."""
        if not self.prompt_seconds:
            return None
        return max(step_budget(self.prompt_seconds), chunk_tokens) + chunk_tokens

    def forward_seconds(self, tokens: int) -> float:
        counts = sorted(self._forward)
        if tokens in self._forward:
            return self._forward[tokens]
        index = bisect.bisect_left(counts, tokens)
        if index == 0:
            return self._forward[counts[0]]
        if index == len(counts):
            if len(counts) == 1:
                return self._forward[counts[0]] * tokens
            low, high = counts[-2], counts[-1]
        else:
            low, high = counts[index - 1], counts[index]
        slope = (self._forward[high] - self._forward[low]) / (high - low)
        return max(self._forward[low] + slope * (tokens - low), self._forward[counts[0]])

    def observe(self, tokens: int, seconds: float, paths: int = 1) -> None:
        """A target forward over ``tokens`` rows making ``paths`` root-to-leaf paths (1: chains)."""
        if paths > 1:
            self.observe_tree_forward(tokens, paths, seconds)
        else:
            self.observe_forward(tokens, seconds)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """EWMA for the observed k; every other k moves by the same relative step, so points
        the engine rarely runs (it mostly runs k = 1 and its current γ + 1) follow the level
        set by the context length and the machine's load while keeping their measured shape."""
        previous = self.forward_seconds(tokens)
        step = self.decay * (seconds / previous - 1.0)
        for count in self._forward:
            self._forward[count] *= 1.0 + step
        self._forward[tokens] = (1 - self.decay) * previous + self.decay * seconds

    def tree_forward_seconds(self, tokens: int, paths: int) -> float:
        """A forward over ``tokens`` rows of which a tree's nodes make ``paths`` paths."""
        return self.forward_seconds(tokens) + self.tree_path_seconds * max(paths - 1, 0)

    def observe_tree_forward(self, tokens: int, paths: int, seconds: float) -> None:
        """A tree verify teaches the per-path cost, never the chain curve."""
        if paths > 1:
            extra = max(0.0, (seconds - self.forward_seconds(tokens)) / (paths - 1))
            self.tree_path_seconds = (1 - self.decay) * self.tree_path_seconds + self.decay * extra

    def observe_draft_token(self, seconds: float) -> None:
        self.draft_token_seconds = (1 - self.decay) * self.draft_token_seconds + self.decay * seconds


def step_budget(seconds: dict[int, float], fraction: float = BUDGET_THROUGHPUT_FRACTION) -> int:
    """The fewest tokens T among those timed whose forward's throughput T / C(T) reaches
    ``fraction`` of the best: the knee where a bigger step stops paying (vLLM's
    ``max_num_batched_tokens``, chosen from this machine's curve instead of a constant)."""
    rates = {tokens: tokens / cost for tokens, cost in seconds.items() if cost > 0}
    if not rates:
        raise ValueError("a step budget needs at least one timed forward")
    best = max(rates.values())
    return min(tokens for tokens, rate in rates.items() if rate >= fraction * best)


def timed(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


@dataclass
class PolicyConfig:
    max_gamma: int = 16  # most draft tokens auto will verify at once (the cost model says how many pay)
    acceptance_prior: float = 0.8  # optimistic start (measured best on rag_quote); the first cycles correct it
    acceptance_decay: float = 0.3  # EWMA weight of the newest observation
    probe_interval: int = 8  # declined cycles before a probe re-measures acceptance
    probe_gamma: int = 2  # tokens verified by a probe
    min_output_tokens: int | None = None  # below this max_tokens, never draft (None: from cost model)
    max_active_sequences: int | None = None  # more active sequences than this: never draft
    tree_nodes: int = 0  # most nodes of a draft tree (chain included); 0: chains only
    branch_prior: float = 0.3  # a branch's start is a lesser match that the chain's failure must leave open


@dataclass
class AcceptanceEstimate:
    """Per-position acceptance, conditional on the earlier positions being accepted.

    Positions never observed (γ has not reached them yet) take ``continuation``, the pooled
    acceptance of every observed position after the first, once there is one: a copied
    passage that has matched for a few tokens tends to go on matching, so the rate seen at
    positions 2..γ says more about position γ + 1 than the prior does. Without it the
    policy could never learn that a γ beyond the positions it has tried would pay.
    """

    prior: float
    decay: float
    rates: list[float] = field(default_factory=list)
    declined: int = 0  # consecutive cycles the policy chose γ = 0 for this source
    continuation: float | None = None
    observed: int = 0  # verify cycles seen by this copy (a request's own, for a carried one)

    def rate(self, position: int) -> float:
        if position < len(self.rates):
            return self.rates[position]
        if position > 0 and self.continuation is not None:
            return self.continuation
        return self.prior

    def observe(self, gamma: int, accepted_len: int) -> None:
        # Positions up to the first rejection were observed; later ones were not.
        self.observed += 1
        for position in range(min(accepted_len + 1, gamma)):
            if position >= len(self.rates):
                self.rates.append(self.rate(position))
            seen = 1.0 if position < accepted_len else 0.0
            self.rates[position] = (1 - self.decay) * self.rates[position] + self.decay * seen
            if position > 0:
                previous = self.prior if self.continuation is None else self.continuation
                self.continuation = (1 - self.decay) * previous + self.decay * seen

    def expected_committed(self, gamma: int) -> float:
        expected, survive = 1.0, 1.0
        for position in range(gamma):
            survive *= self.rate(position)
            expected += survive
        return expected

    def copy(self) -> AcceptanceEstimate:
        return AcceptanceEstimate(self.prior, self.decay, list(self.rates), 0, self.continuation)


NGRAM_BUCKETS = ((4, "n4+"), (2, "n2-3"), (1, "n1"))  # (shortest n, label), longest first


def estimate_key(source: str, match_ngram: int = 0) -> str:
    """The estimate a draft is judged by: its source, and its n-gram bucket for a lookup."""
    if match_ngram <= 0:
        return source
    label = next(label for shortest, label in NGRAM_BUCKETS if match_ngram >= shortest)
    return f"{source}@{label}"


def source_kind(key: str) -> str:
    """What a shared estimate is kept for: passages are named by the caller, one kind."""
    source, at, bucket = key.partition("@")
    kind = source if source in SOURCE_KINDS else "passage"
    return f"{kind}{at}{bucket}"


@dataclass
class StepLoad:
    """What the shared forward of a packed step already carries when a sequence decides:
    ``tokens`` scheduled so far and the tokens they are expected to commit. Alone, both 0."""

    tokens: int = 0
    committed: float = 0.0


def best_gamma(
    estimate: AcceptanceEstimate,
    cost: CostModel,
    draft_token_seconds: float,
    max_gamma: int,
    load: StepLoad | None = None,
) -> tuple[int, float]:
    """The γ in 0..max_gamma with the highest expected committed tokens per second.

    In a packed step the rate is the whole step's: every sequence already in it waits for
    the forward that γ more tokens lengthen, so γ must raise the step's committed tokens
    per second, (committed + E[γ]) / C(tokens + γ + 1) against (committed + 1) / C(tokens + 1).
    Alone (no load) this is the batch-1 rule E[γ] / C(γ + 1) against 1 / C(1).
    """
    load = load or StepLoad()
    best, best_rate = 0, (load.committed + 1.0) / cost.forward_seconds(load.tokens + 1)
    for gamma in range(1, max_gamma + 1):
        seconds = gamma * draft_token_seconds + cost.forward_seconds(load.tokens + gamma + 1)
        rate = (load.committed + estimate.expected_committed(gamma)) / seconds
        if rate > best_rate:
            best, best_rate = gamma, rate
    return best, best_rate


@dataclass
class Decision:
    gamma: int  # 0: a plain step
    reason: str | None = None  # why not speculating, or "probe"
    rate: float = 0.0  # expected committed tokens per second (auto only), to compare drafters
    expected: float = 1.0  # tokens the cycle is expected to commit (auto only)


class RequestPolicy:
    """The per-request state of the policy: mode, acceptance estimates, probe counters."""

    def __init__(
        self,
        mode: Speculation,
        fixed_gamma: int,
        config: PolicyConfig,
        cost: CostModel | None,
        supported: bool = True,
        shared: dict[str, AcceptanceEstimate] | None = None,
    ) -> None:
        self.mode = mode
        self.fixed_gamma = fixed_gamma
        self.config = config
        self.cost = cost
        self.supported = supported
        # The engine's estimates per source kind, carried across requests: a new request
        # starts from what earlier ones measured instead of the prior, and updates them.
        self.shared = shared
        self._estimates: dict[str, AcceptanceEstimate] = {}

    def estimate(self, key: str) -> AcceptanceEstimate:
        """The request's estimate for ``key`` (``estimate_key``), first copied from the shared one."""
        if key not in self._estimates:
            known = self.shared.get(source_kind(key)) if self.shared is not None else None
            self._estimates[key] = known.copy() if known is not None else self._fresh_estimate(key)
        return self._estimates[key]

    def _fresh_estimate(self, key: str = "") -> AcceptanceEstimate:
        prior = self.config.branch_prior if key.startswith(BRANCH_SOURCE) else self.config.acceptance_prior
        return AcceptanceEstimate(prior, self.config.acceptance_decay)

    def plan(self, remaining_tokens: int, active_sequences: int) -> Decision:
        """Gates that apply whatever the drafter; returns the most tokens worth drafting."""
        if self.mode == "off":
            return Decision(0, OFF_BY_REQUEST)
        # A cycle commits at most γ + 1 tokens; drafting past max_tokens only wastes verify work.
        cap = min(self.fixed_gamma if self.mode == "on" else self.config.max_gamma, remaining_tokens - 1)
        if cap <= 0:
            return Decision(0, NEAR_MAX_TOKENS)
        if self.mode == "on":
            return Decision(cap)
        if not self.supported:
            return Decision(0, UNSUPPORTED)
        limit = self.config.max_active_sequences
        if limit is not None and active_sequences > limit:
            return Decision(0, BATCH_SATURATED)
        return Decision(cap)

    def for_draft(self, source: str, proposed: int, match_ngram: int = 0, load: StepLoad | None = None) -> Decision:
        """How many of ``proposed`` free (prompt-lookup) draft tokens to verify."""
        if self.mode != "auto":
            return Decision(proposed)
        return self._choose(estimate_key(source, match_ngram), proposed, 0.0, load)

    def for_costly_drafter(
        self,
        source: str,
        cap: int,
        cost_per_token: float,
        setup_tokens: int,
        remaining_tokens: int,
        min_output_tokens: int | None = None,
        load: StepLoad | None = None,
    ) -> Decision:
        """How many tokens a drafter that costs time per token (a model) should draft.

        ``setup_tokens``: what it must ingest before its first proposal (its prefill).
        """
        if self.mode != "auto":
            return Decision(cap)
        if remaining_tokens < self.short_output_threshold(setup_tokens, min_output_tokens):
            return Decision(0, SHORT_OUTPUT)
        return self._choose(source, cap, cost_per_token, load)

    def observe(self, source: str, gamma: int, accepted_len: int, match_ngram: int = 0) -> None:
        key = estimate_key(source, match_ngram)
        self.estimate(key).observe(gamma, accepted_len)
        if self.shared is not None:
            self.shared.setdefault(source_kind(key), self._fresh_estimate(key)).observe(gamma, accepted_len)

    def short_output_threshold(self, setup_tokens: int, override: int | None = None) -> int:
        """Fewest tokens still to produce for speculation to pay back the drafter's set-up:
        set-up seconds over the seconds saved per token at the prior acceptance."""
        for configured in (override, self.config.min_output_tokens):
            if configured is not None:
                return configured
        if setup_tokens == 0 or self.cost is None or self.cost.draft_prefill_token_seconds <= 0:
            return 0
        prior = self._fresh_estimate()
        gamma, rate = best_gamma(prior, self.cost, self.cost.draft_token_seconds, self.config.max_gamma)
        saving_per_token = self.cost.forward_seconds(1) - 1.0 / rate
        if gamma == 0 or saving_per_token <= 0:
            return 1 << 30  # speculation would not pay at any length
        return math.ceil(setup_tokens * self.cost.draft_prefill_token_seconds / saving_per_token)

    def _choose(self, source: str, cap: int, draft_cost_per_token: float, load: StepLoad | None) -> Decision:
        estimate = self.estimate(source)
        if self.cost is None:
            return Decision(cap)
        gamma, rate = best_gamma(estimate, self.cost, draft_cost_per_token, cap, load)
        if gamma > 0:
            estimate.declined = 0
            return Decision(gamma, rate=rate, expected=estimate.expected_committed(gamma))
        estimate.declined += 1
        if estimate.observed == 0 or estimate.declined > self.config.probe_interval:
            estimate.declined = 0
            return Decision(min(cap, self.config.probe_gamma), "probe")
        return Decision(0, LOW_ACCEPTANCE)
