"""Causal LMs and tokenizers: loading them from a directory (the shipped tiny model included),
turning dropout off, greedy exact-match accuracy; exporting a run's trained policy as a Hugging
Face model directory (export.py). Used by backends, scripts, the command line and the end of a run;
no orchestrator imports."""
