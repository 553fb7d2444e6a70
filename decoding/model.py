"""Loading a causal LM and running it over a sequence's KV cache.

Token ids in, logits out. ``load_model`` takes a pack name (docs/design.md), a local Hugging
Face folder, a ``.gguf`` path (converted once to safetensors), or a hub id where a hub is
reachable; this process sets ``HF_HUB_OFFLINE=1`` unless told otherwise.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specrag.decoding import dtype_choice, packs
from specrag.decoding.fast_paths import install_fast_paths, uses_specrag_attention
from specrag.decoding.kv import SequenceKV

if TYPE_CHECKING:
    from specrag.decoding.grammar_compile import GrammarCompiler

# Prompts are prefilled in chunks that end on multiples of this many positions: a long
# prompt never needs one giant activation tensor, the engine spreads it over steps
# (one chunk a step, beside the other sequences' tokens), and a chunk is the same rows
# whether the engine or ``CausalLM.prefill`` cuts it. A multiple of the prefix cache's
# and the prompt attention's block (32).
PREFILL_CHUNK_TOKENS = 256


def prompt_chunk_end(start: int, total: int, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> int:
    """Where the prefill chunk that starts at position ``start`` of ``total`` ends."""
    return min(total, (start // chunk_tokens + 1) * chunk_tokens)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype = "auto", device: torch.device | None = None, config: Any = None
) -> torch.dtype:
    """``auto``: bf16 on CUDA; on a CPU, float32 without native bf16 matmuls, else the dtype
    measured faster for this model's shapes (``decoding/dtype_choice.py``; without a config,
    bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp64": torch.float64,
        "float64": torch.float64,
    }
    if dtype in names:
        return names[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(names)}")
    device = device or resolve_device()
    if device.type == "cuda":
        return torch.bfloat16
    if config is not None:
        return dtype_choice.auto_cpu_dtype(config)
    return torch.bfloat16 if dtype_choice.cpu_has_native_bf16() else torch.float32


class CausalLM:
    """A causal LM (any transformers ``*ForCausalLM``) plus its tokenizer, if any."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        name: str = "model",
        fast_paths: bool = True,
        row_exact: bool = True,
        few_rows: bool = False,
    ) -> None:
        self.model = install_fast_paths(model.eval()) if fast_paths else model.eval()
        self.fast_paths = fast_paths
        # Row-exact linears for forwards of few rows (one sequence at a time, short drafts)
        # rather than a server's packed steps: decoding/batch_invariance.py, mkl_blocks_preferred.
        self.few_rows = few_rows
        self.tokenizer = tokenizer
        self.name = name
        # True once the probes of decoding/batch_invariance.py showed that a verify forward
        # gives the same logits as one-token steps, bit for bit, on this machine.
        self.row_exact = False
        # True once they showed that every linear gives a row the same bits whatever the
        # other rows: a packed step then gives each sequence its own forward's logits.
        self.linears_row_exact = False
        if fast_paths and row_exact:
            from specrag.decoding.batch_invariance import enable_row_exact

            enable_row_exact(self)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def batch_invariant(self) -> bool:
        """Whether a sequence's logits are the same bits beside others in a packed forward
        as alone: row-exact linears, and attention per sequence by the same call."""
        return self.row_exact or self.linears_row_exact

    @property
    def packs_prompts(self) -> bool:
        """Whether packed forwards work: they need specrag's attention (``fast_paths``)."""
        return uses_specrag_attention(self.model)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles JSON-schema and tool-call grammars for this model's vocabulary (cached)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name!r} has no tokenizer: grammars need its vocabulary")
        from specrag.decoding.grammar_compile import GrammarCompiler

        return GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size)

    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: generation config's eos plus the tokenizer's."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(item) for item in value)
        return ids

    def new_kv(self) -> SequenceKV:
        return SequenceKV(self.config, growable=self.fast_paths)

    @torch.inference_mode()
    def forward(self, kv: SequenceKV, token_ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Append ``token_ids`` to ``kv`` and return their logits as float32.

        Returns [len(token_ids), V], or [1, V] for the last position when ``last_only``
        (the vocabulary projection of the other positions is then skipped).
        """
        if not token_ids:
            raise ValueError("forward needs at least one token")
        if self.packs_prompts:  # the call a packed step makes for it, so alone = beside others
            from specrag.decoding.packed import Chunk, packed_forward

            return packed_forward(self, [Chunk(kv, token_ids, last_only=last_only)])[0]
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # stock attention
        output = self.model(input_ids=ids, cache=kv.cache, use_cache=True, logits_to_keep=1 if last_only else 0)
        kv.record(token_ids)
        return output.logits[0].float()

    def forward_prompt(self, kv: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Append prompt rows (one prefill chunk) to ``kv``, attended as prompt rows
        (``fast_paths.attend_prompt_blocks``) where the packed call works; the last row's logits [1, V]."""
        if not self.packs_prompts:
            return self.forward(kv, token_ids, last_only=True)
        from specrag.decoding.packed import Chunk, packed_forward  # packed calls back into this model

        return packed_forward(self, [Chunk(kv, token_ids, prompt=True, last_only=True)])[0]

    def prefill(self, kv: SequenceKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Forward prompt rows after what ``kv`` holds, in the chunks the engine cuts
        (``prompt_chunk_end``), attended as prompt rows; returns the last position's logits [V]."""
        if not token_ids:
            raise ValueError("prefill needs a non-empty prompt")
        start, total, done = len(kv), len(kv) + len(token_ids), 0
        while start < total:
            end = prompt_chunk_end(start, total)
            piece = token_ids[done : done + end - start]
            logits = self.forward_prompt(kv, piece)
            done, start = done + len(piece), end
        return logits[-1]


def load_model(
    spec: str | os.PathLike[str],
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    progress: bool = True,
    fast_paths: bool = True,
    row_exact: bool = True,
    few_rows: bool = False,
) -> CausalLM:
    """Load a pack by name, a local HF folder, a ``.gguf`` file, or a hub id.

    ``few_rows``: the model will run one sequence at a time (a CLI, a single-user agent), so
    its row-exact linears take the kernels fastest for forwards of a few rows where they
    differ (float32 on AVX512 CPUs); a server's packed steps want the default."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = _local_folder(str(spec), progress)
    target_device = resolve_device(device)
    config = AutoConfig.from_pretrained(path) if dtype == "auto" and target_device.type == "cpu" else None
    target_dtype = resolve_dtype(dtype, target_device, config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = Path(spec).name if Path(spec).exists() else str(spec)

    def build(torch_dtype: torch.dtype) -> CausalLM:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(target_device)
        return CausalLM(model, tokenizer, name=name, fast_paths=fast_paths, row_exact=row_exact, few_rows=few_rows)

    lm = build(target_dtype)
    if config is not None and target_dtype == torch.bfloat16 and fast_paths and row_exact and not lm.row_exact:
        # "auto" promises that speculation never changes the text: bf16 logits tie often,
        # and here a verify does not reproduce one-token steps bit for bit.
        warnings.warn(
            f"{name}: bf16 verification is not bit-exact on this CPU; dtype auto falls back to float32",
            stacklevel=2,
        )
        lm = build(torch.float32)
    return lm


def _local_folder(spec: str, progress: bool) -> str:
    if spec in packs.PACKS:
        return str(packs.pull(spec, progress=progress).path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(packs.ensure_gguf_converted(path)[0])
    if path.is_dir():
        return str(path)
    if path.exists() or spec.endswith(".gguf"):
        raise packs.PackError(f"{spec!r} is neither a model folder nor a .gguf file")
    return spec  # a hub id: transformers reports clearly if it is not reachable offline
