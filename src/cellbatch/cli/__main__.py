"""`python -m cellbatch.cli`: the `cellbatch` command."""

import sys

from cellbatch.cli import main

sys.exit(main())
