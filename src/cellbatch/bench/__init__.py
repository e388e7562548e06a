"""The throughput benchmark, shipped with the package so that `cellbatch bench` runs
from an install (matplotlib for its plot: the `cellbatch[bench]` extra).

Imports only go down this list: `workload` (prompts, options) < `report` (figures, JSON)
< `peers` (each engine's run) < `plot` < `throughput` (one run, `main`).
"""
