"""Built-in tools: ``search_documents``, the one implementation of document search.

Inside an agent run the loop binds the run's own retrieval (``search_scope``), so the
passages found get the run's next labels (``[P4]``), become citable and feed prompt
lookup; anywhere else the tool searches the searcher it was built over. Either way the
model sees each passage as in the prompt (``format_passage``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Protocol

from pydantic import Field

from specrag.tools.registry import Tool, tool

NO_PASSAGES = "No passages found."


class Passage(Protocol):
    id: str
    source: str
    text: str


class Searcher(Protocol):
    def search(self, query: str, k: int) -> Sequence[Passage]: ...


# The searcher of the agent run this context belongs to, if any. A context variable, not an
# attribute of the tool: one registry serves concurrent runs, each in its own context
# (``tools/execute.py`` runs a sync tool in a copy of the caller's context).
_RUN_SEARCHER: ContextVar[Searcher | None] = ContextVar("specrag_run_searcher", default=None)


@contextmanager
def search_scope(searcher: Searcher | None) -> Iterator[None]:
    """Within this block, ``search_documents`` tools search ``searcher`` (None: their own)."""
    token = _RUN_SEARCHER.set(searcher)
    try:
        yield
    finally:
        _RUN_SEARCHER.reset(token)


def format_passage(label: str, source: str, text: str) -> str:
    """One passage as the model sees it, in the prompt and in a search tool's result alike."""
    return f"[{label}] ({source})\n{text}"


def search_documents_tool(searcher: Searcher, *, timeout_s: float = 30.0, max_result_chars: int = 24000) -> Tool:
    """The ``search_documents`` tool over ``searcher`` (a ``specrag.retrieval.Retriever``). Its result
    labels a passage with its run label inside an agent run, else with its id."""

    def search_documents(query: str, k: Annotated[int, Field(ge=1, le=20)] = 4) -> str:
        """Search the indexed documents for passages relevant to a query.

        Args:
            query: What to look for, in plain words.
            k: How many passages to return.
        """
        hits = (_RUN_SEARCHER.get() or searcher).search(query, k)
        shown = (format_passage(getattr(hit, "label", hit.id), hit.source, hit.text) for hit in hits)
        return "\n\n".join(shown) or NO_PASSAGES

    return tool(search_documents, timeout_s=timeout_s, max_result_chars=max_result_chars)
