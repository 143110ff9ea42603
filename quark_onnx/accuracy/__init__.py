"""Accuracy recovery under NPU constraints: bias correction, AdaRound, per-layer error analysis."""
