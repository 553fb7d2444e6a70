"""Correctness checks run as scripts: greedy parity of speculative decoding, and the mutation
check that the tests catch planted bugs."""
