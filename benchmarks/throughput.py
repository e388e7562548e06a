"""Generated tokens/s of cellbatch against transformers on the default model (issue 4).

A thin wrapper over `cellbatch.bench` (also reachable as `cellbatch bench`): 32 chat
prompts, greedy, at most 64 new tokens, in one run on the same dtype and threads for
transformers one prompt at a time, transformers on a padded batch, transformers
`generate_batch` and cellbatch; then cellbatch's decode-only tokens/s at 1, 8, 32 and
64 sessions. Writes benchmarks/results/throughput-<dtype>.json and a PNG beside it.

Usage: .venv/bin/python benchmarks/throughput.py [--dtype float32|bfloat16] [--threads N]
       [--quick] [--model PATH] [--output-json PATH]   (--help for the rest)
"""

from __future__ import annotations

import sys

from cellbatch.bench import main

if __name__ == "__main__":
    sys.exit(main())
