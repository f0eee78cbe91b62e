"""`collect` as a process that SIGKILLs itself at a step of one of its checkpoints (tests only).

    python -m tests.collect_crash --crash-at committed@2 collect --fleet ... [collect's flags]

`--crash-at <step>@<n>` kills the collector at `<step>` of its n-th checkpoint (n defaults to
1): `prepared` (the fleet is prepared), `committed` (parts written, nothing published) or a
publication step (`after_verify`, `after_fleet_manifest`, `after_latest`); or at the n-th
edge of the receipt protocol: `received` (a result's reply arrived, its line not written),
`persisted` (a sealed group's lines durable, not acknowledged), `acknowledging`, `acknowledged` (an
acknowledgement round about to leave, come back). `--stop-at` instead
SIGSTOPs it there (the test SIGCONTs it once it has done something to the fleet meanwhile). The
hook reaches the collector through `run_collect(step_hook=...)`; production code has no switch
for it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from rollout_checkpoint.client.collect import add_collect_verb, run_collect

STEPS = (
    "prepared",
    "committed",
    "after_verify",
    "after_fleet_manifest",
    "after_latest",
    # The receipt protocol's edges, numbered by their own count (receipts.DeliverySteps).
    "received",
    "persisted",
    "acknowledging",
    "acknowledged",
)


def crash_point(text: str) -> tuple[str, int]:
    """`<step>@<n>` (or `<step>`, meaning n = 1) as (step, n)."""
    step, _, number = text.partition("@")
    if step not in STEPS:
        raise argparse.ArgumentTypeError(f"{step!r} is not a checkpoint step: one of {STEPS}")
    return step, int(number or "1")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.collect_crash")
    point = parser.add_mutually_exclusive_group(required=True)
    point.add_argument("--crash-at", type=crash_point, help="<step>@<n>: SIGKILL there")
    point.add_argument("--stop-at", type=crash_point, help="<step>@<n>: SIGSTOP there")
    add_collect_verb(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    at: tuple[str, int] = args.crash_at or args.stop_at
    signum = signal.SIGKILL if args.crash_at else signal.SIGSTOP

    def step_hook(step: str, checkpoint_number: int) -> None:
        if (step, checkpoint_number) == at:
            os.kill(os.getpid(), signum)

    return run_collect(
        args, [sys.executable, "-m", "tests.collect_crash", *argv], step_hook=step_hook
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
