"""Evaluation of trained runs (``python -m experiments.evaluate``): restore a checkpoint, carry state over
long inputs chunk by chunk, and the suites (perplexity, position-wise perplexity, Effective Remembrance,
state statistics, KDN write strength, retrieval grids)."""
