"""Benchmarks: decoding, serving, prompt lookup, forwards, packing, prefix cache, retrieval;
``specrag bench`` runs some of them, ``python -m specrag.evals.bench.NAME`` any."""
