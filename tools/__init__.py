"""`@tool` functions, schemas and execution (arrives with the tools issue)."""
