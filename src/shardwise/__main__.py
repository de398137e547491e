"""`python -m shardwise` (what `torchrun -m shardwise train job.toml` runs in every rank)."""

import sys

from shardwise.cli import main

if __name__ == "__main__":
    sys.exit(main())
