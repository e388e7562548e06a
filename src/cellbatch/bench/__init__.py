"""The throughput benchmark, shipped with the package so that `cellbatch bench` runs
from an install (matplotlib for its plot: the `cellbatch[bench]` extra).

Imports only go down this list: `workload` (prompts, options) < `report` (figures, JSON)
< `peers` (each engine's run) < `vllm_peer` (vLLM's CPU build as a peer) < `plot` <
`throughput` (one run, `main`). `vllm_driver.py` runs in vLLM's own virtualenv and imports
nothing of cellbatch.
"""
