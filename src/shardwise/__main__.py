"""`python -m shardwise` (what `torchrun -m shardwise train job.toml` runs in every rank)."""

import sys

from shardwise.cli import main, owned_process

if __name__ == "__main__":
    owned_process()
    sys.exit(main())
