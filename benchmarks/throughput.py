"""Generated tokens/s of cellbatch against Hugging Face transformers: `cellbatch bench`
from a checkout (the benchmark ships in the package as `cellbatch.bench`).

Usage: .venv/bin/python benchmarks/throughput.py [options]   (--help for them)
"""

import sys

from cellbatch.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
