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
for it. `--acknowledge-after-checkpoint` holds the run's first acknowledgement round until a
checkpoint it asks for is published (`AcknowledgementGate`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

from rollout_checkpoint.client.collect import add_collect_verb, run_collect
from rollout_checkpoint.client.collect.receipts import Acknowledgements

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


class AcknowledgementGate:
    """Orders a run's first acknowledgement round after a checkpoint: the round (results
    persisted, their receipts owed) asks for a checkpoint (SIGUSR1, as an operator would)
    and waits until one whose fleet was prepared after that is published, so that
    checkpoint's outbox holds every result the round then releases. A loss after the round
    restores results the collector already wrote and acknowledged, deterministically."""

    def __init__(self) -> None:
        self.waiting = False
        self.prepared = False
        self.published = asyncio.Event()

    def step(self, step: str) -> None:
        if step == "prepared" and self.waiting:
            self.prepared = True
        elif step == "after_latest" and self.prepared:
            self.published.set()

    def install(self) -> None:
        flush = Acknowledgements.flush
        gate = self

        async def flush_after_a_checkpoint(acknowledgements: Acknowledgements) -> bool:
            if not gate.waiting and acknowledgements.ledger.to_acknowledge():
                gate.waiting = True
                os.kill(os.getpid(), signal.SIGUSR1)
                await gate.published.wait()
            return await flush(acknowledgements)

        Acknowledgements.flush = flush_after_a_checkpoint  # type: ignore[method-assign]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.collect_crash")
    point = parser.add_mutually_exclusive_group(required=True)
    point.add_argument("--crash-at", type=crash_point, help="<step>@<n>: SIGKILL there")
    point.add_argument("--stop-at", type=crash_point, help="<step>@<n>: SIGSTOP there")
    parser.add_argument("--acknowledge-after-checkpoint", action="store_true")
    add_collect_verb(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    at: tuple[str, int] = args.crash_at or args.stop_at
    signum = signal.SIGKILL if args.crash_at else signal.SIGSTOP
    gate = AcknowledgementGate()
    if args.acknowledge_after_checkpoint:
        gate.install()

    def step_hook(step: str, checkpoint_number: int) -> None:
        gate.step(step)
        if (step, checkpoint_number) == at:
            os.kill(os.getpid(), signum)

    return run_collect(
        args, [sys.executable, "-m", "tests.collect_crash", *argv], step_hook=step_hook
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
