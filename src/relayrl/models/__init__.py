"""Causal LMs and tokenizers: loading them from a directory (the shipped tiny model included),
turning dropout off, greedy exact-match accuracy. Used by backends and scripts; no orchestrator
imports."""
