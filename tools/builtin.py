"""Built-in tools. ``search_documents`` is bound to a retriever by the agent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Protocol

from pydantic import Field

from tools.registry import Tool, tool


class Passage(Protocol):
    id: str
    source: str
    text: str


class Searcher(Protocol):
    def search(self, query: str, k: int) -> Sequence[Passage]: ...


def search_documents_tool(searcher: Searcher, *, timeout_s: float = 30.0, max_result_chars: int = 8000) -> Tool:
    """The ``search_documents`` tool over ``searcher`` (a ``retrieval.Retriever``)."""

    def search_documents(query: str, k: Annotated[int, Field(ge=1, le=20)] = 4) -> list[dict[str, Any]]:
        """Search the indexed documents for passages relevant to a query.

        Args:
            query: What to look for, in plain words.
            k: How many passages to return.
        """
        return [{"id": hit.id, "source": hit.source, "text": hit.text} for hit in searcher.search(query, k)]

    return tool(search_documents, timeout_s=timeout_s, max_result_chars=max_result_chars)
