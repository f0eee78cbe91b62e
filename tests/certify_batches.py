"""`rollout-checkpoint certify` with restore checks every N trials (tests only).

    python -m tests.certify_batches N certify --fleet ... [certify's flags]

A test interrupts a run between two batches of restore checks, so that when it stops some
trials are decided and others only ran; with the default batch (`run.RESTORE_BATCH`, 25) a
short run has a single batch. Production code has no switch for it.
"""

from __future__ import annotations

import sys

from rollout_checkpoint.client.certify import run
from rollout_checkpoint.client.cli.main import main

if __name__ == "__main__":
    run.RESTORE_BATCH = int(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
