"""The agent loop, prompts, traces, HTTP server and the `specrag` CLI."""

from specrag import decoding  # noqa: F401  (first: it sets HF_HUB_OFFLINE before any hub library loads)
