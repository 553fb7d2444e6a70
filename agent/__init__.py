"""The agent loop, prompts, traces, HTTP server and the `specrag` CLI."""
