"""``Agent``: the Python API. Models, engine, index and tools wired into the agent loop.

    agent = Agent(tools=[get_weather], index="~/.cache/specrag/index/sample", model="qwen2.5-coder-0.5b")
    result = agent.run("What does the with statement do?")   # the POST /v1/agent/runs shape

The engine is not thread-safe. By default ``Agent`` serialises runs with a lock; with
``concurrent=True`` an engine worker thread (``agent/worker.py``) owns the engine and runs
from many threads interleave cycle by cycle, as the HTTP server needs.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from specrag.agent.events import AgentEvent
from specrag.agent.loop import AgentLoop, RunOptions
from specrag.agent.tool_gate import ToolRelevance
from specrag.agent.trace import Tracer, TraceStore
from specrag.agent.trace_otel import export_from_env
from specrag.agent.worker import EngineWorker
from specrag.decoding.engine import Engine
from specrag.decoding.grammar import Grammar
from specrag.decoding.model import CausalLM, load_model
from specrag.decoding.prefix_cache import PrefixCache
from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.retrieval.embed import Embedder
from specrag.tools import Tool, ToolRegistry, search_documents_tool
from specrag.tools.formats import FORMATS, CallFormat

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class AgentRuns:
    """``run``, ``stream`` and ``trace`` over ``self.loop`` and ``self.tracer``: the API that
    ``Agent`` and the remote-engine agent (``agent/remote.py``) share."""

    loop: AgentLoop
    tracer: Tracer

    def run(self, question: str, options: RunOptions | None = None, **overrides: Any) -> dict[str, Any]:
        """Run to the final answer: ``{run_id, answer, citations, steps, usage, speculation, trace_id}``.

        ``options`` (the one ``RunOptions`` type the HTTP API, the CLI and the evals build too),
        with ``overrides`` of its fields: ``agent.run(q, max_tokens=64)`` or ``agent.run(q, opts)``.
        """
        return self.loop.run(question, resolve_options(options, overrides))

    def stream(self, question: str, options: RunOptions | None = None, **overrides: Any) -> Iterator[AgentEvent]:
        """The run as events: ``token``, ``tool_call``, ``tool_result``, ``final`` or ``error``."""
        return self.loop.events(question, resolve_options(options, overrides))

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        store = self.tracer.store
        return store.get(trace_id) if store is not None else None


class Agent(AgentRuns):
    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        index: str | os.PathLike[str] | Any = None,
        model: str | os.PathLike[str] | CausalLM = DEFAULT_MODEL,
        draft: str | os.PathLike[str] | CausalLM | None = None,
        *,
        dtype: str = "auto",
        system: str | None = None,
        prefix_cache: PrefixCache | bool = True,
        tracer: Tracer | None = None,
        search_tool: bool = True,
        concurrent: bool = False,
        max_in_flight: int = 32,
        call_format: CallFormat | str | None = None,
    ) -> None:
        self.model = model if isinstance(model, CausalLM) else load_model(model, dtype=dtype)
        self.draft = draft if isinstance(draft, CausalLM) or draft is None else load_model(draft, dtype=dtype)
        self.engine = Engine(self.model, self.draft, prefix_cache=prefix_cache)
        self.retriever = open_index(index)
        self.registry = ToolRegistry(tools)
        if self.retriever is not None and search_tool and "search_documents" not in self.registry:
            self.registry.register(search_documents_tool(self.retriever))
        self.tracer = tracer or Tracer(store=TraceStore(export=export_from_env()))
        self._lock = threading.Lock()
        self.worker = EngineWorker(self.engine, max_in_flight) if concurrent else None
        self.loop = AgentLoop(
            self.model.tokenizer,
            self.generate,
            self.registry,
            self.grammar_for,
            self.retriever,
            model_name=self.model.name,
            system=system,
            tracer=self.tracer,
            call_format=FORMATS[call_format] if isinstance(call_format, str) else call_format,
            relevance=ToolRelevance(self.retriever.embedder if self.retriever is not None else Embedder()),
            intent_gate=True,
        )

    @property
    def call_format(self) -> CallFormat:
        """How the model writes tool calls (its chat template's format, or bare JSON)."""
        return self.loop.call_format

    def grammar_for(self, registry: ToolRegistry, names: Sequence[str], call_format: CallFormat) -> Grammar:
        """Calls to ``names`` in ``call_format`` or plain text; only text when ``names`` is
        empty (compiled once per tool set)."""
        compiler = self.model.grammar_compiler
        if not names:
            return compiler.text_answer(call_format.syntax)
        chosen = ToolRegistry([registry.get(name) for name in names])
        return chosen.grammar(compiler, allow_text=True, syntax=call_format.syntax)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Token ids in, events out, through the worker (concurrent) or under the lock."""
        if self.worker is not None:
            yield from self.worker.generate(request)
            return
        with self._lock:
            yield from self.engine.generate(request)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()


def open_index(index: str | os.PathLike[str] | Any) -> Any:
    """A Retriever over ``index`` (a directory), ``index`` itself if it searches already, or None."""
    if index is None or hasattr(index, "search_with_timings"):
        return index
    from specrag.retrieval import Retriever

    return Retriever.open(Path(index).expanduser())


def resolve_options(options: RunOptions | None, overrides: dict[str, Any]) -> RunOptions:
    """``options`` (default ``RunOptions()``) with ``overrides`` of its fields, validated again."""
    return dataclasses.replace(options or RunOptions(), **overrides)
