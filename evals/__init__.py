"""Benchmarks and evals; they drive the public interfaces only."""
