"""What the checkpoint history costs a 1,000-member fleet's checkpoint (issue 32: at most 1.03x).

    python -m benchmarks.history_cost [--members 1000] [--rounds 7] [--hosts 2] [--calibrate]

One invocation, one JSON line on stdout, nothing written into the repository (checkpoints and
host logs go to a temporary directory, removed at the end). The fleet is benchmark 6's
(`benchmarks.light_fleet`: real sidecars, each its own port and control plane, over an
always-ready participant with a few tiny episodes, in `--hosts` processes). Each round takes
one published checkpoint with its history (`checkpointing.checkpoint`: the recorder watches
every event, times every member's commit and writes the entry and the per-member details
into the root once the fleet resumed) and one without (the very steps `checkpoint` runs,
`checkpoint._checkpoint`, with no recorder and no member timing), in this process, the order
alternating round by round so neither always runs on the warmer caches; a first round of
both is unmeasured. Each side has its own root, and retention keeps every checkpoint
(`KEEP`): deleting a 1,000-part checkpoint on a disk shared with other work took 0.1 to 7 s
from one round to the next, noise that hid what is measured here.

Figures: the fleet's pause (the call until every member answered its Resume: what the
history must not lengthen), the whole call (the history's write included: `checkpoint`
yields its last event once the record is written), this process's CPU over the call and
until the resume starts (prepare, commit, publish: most of the pause's CPU, and less
sensitive than the pause's wall time to whatever else the machine runs), each
as the median of per-round ratios with / without and the medians of both sides; and the
record, what the call took after the resume and the retention (with history: building the
record and waiting for its write; without: nothing but the last event). `--calibrate` runs
both sides without history: on a machine shared with other work, the spread of those ratios is
what any one ratio here can be trusted to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rollout_checkpoint.client.checkpointing import checkpoint as checkpointing
from rollout_checkpoint.client.checkpointing.checkpoint import CheckpointEvent, Phase
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.checkpointing.publication.history import INDEX_NAME
from rollout_checkpoint.client.fleet import DEFAULT_FAN_OUT, Fleet, FleetSpec

from .common import Processes, deadline_in, now, ratios, spread
from .light_scale import member_specs, start_hosts

TIMEOUT = 300.0
SIDES = ("with", "without")
KEEP = 1000
"""More than a run takes: retention deletes nothing."""


def recorded(fleet: Fleet, root: CheckpointRoot, deadline: float) -> AsyncIterator[CheckpointEvent]:
    """A checkpoint as every coordinator takes one: recorded in the root's history."""
    return checkpointing.checkpoint(fleet, root, deadline, scope=None, keep=KEEP)


def unrecorded(
    fleet: Fleet, root: CheckpointRoot, deadline: float
) -> AsyncIterator[CheckpointEvent]:
    """The same steps without the history: no recorder, no member timing (what a checkpoint
    was before issue 32)."""
    return checkpointing._checkpoint(
        fleet, root, deadline, root.new_checkpoint_id(), None, b"", KEEP, False, None, False, None
    )


async def one_checkpoint(
    fleet: Fleet, root: CheckpointRoot, side: str, calibrating: bool
) -> dict[str, float]:
    """One published checkpoint: its pause, the whole call, this process's CPU and the record
    (the call after the resume and the retention), in seconds."""
    take = recorded if side == "with" and not calibrating else unrecorded
    cpu = time.process_time()
    started = now()
    outcome = None
    cpu_to_resume = math.nan
    async for event in take(fleet, root, deadline_in(TIMEOUT)):
        if event.phase == Phase.RESUME:
            cpu_to_resume = time.process_time() - cpu
        outcome = event.outcome if event.final else outcome
    total = now() - started
    cpu = time.process_time() - cpu
    if outcome is None or outcome.published is None or outcome.resumed_seconds is None:
        raise RuntimeError(f"the checkpoint {side} history was not published: {outcome}")
    record = total - outcome.resumed_seconds - outcome.retention_seconds
    return {
        "pause": outcome.resumed_seconds,
        "total": total,
        "cpu": cpu,
        "cpu_to_resume": cpu_to_resume,
        "record": record,
    }


async def measure(
    fleet: Fleet, work: Path, rounds: int, calibrating: bool
) -> dict[str, list[dict[str, float]]]:
    """`rounds` measured rounds (after one unmeasured), each side once a round, alternating
    which goes first. `calibrating`: both sides without history, the same checkpoint twice a
    round, so the ratios say how far apart this machine puts two identical runs."""
    roots = {side: CheckpointRoot(work / side) for side in SIDES}
    timings: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for number in range(-1, rounds):
        order = SIDES if number % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            timing = await one_checkpoint(fleet, roots[side], side, calibrating)
            if number >= 0:
                timings[side].append(timing)
        if number >= 0:
            print(f"round {number + 1}/{rounds}: {_line(timings)}", file=sys.stderr, flush=True)
    if (work / "without" / INDEX_NAME).exists() or calibrating == (
        work / "with" / INDEX_NAME
    ).exists():
        raise RuntimeError("only the side with history must have written one")
    return timings


def _line(timings: dict[str, list[dict[str, float]]]) -> str:
    return ", ".join(
        f"{side}: pause {t['pause']:.3f}s, total {t['total']:.3f}s, record {t['record']:.3f}s"
        for side, t in ((side, timings[side][-1]) for side in SIDES)
    )


def report(timings: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per figure: both sides' spreads and the per-round ratios with / without."""
    figures = {}
    for figure in ("pause", "total", "cpu", "cpu_to_resume", "record"):
        with_history = [t[figure] for t in timings["with"]]
        without = [t[figure] for t in timings["without"]]
        figures[figure] = {
            "with_history_seconds": spread(with_history),
            "without_seconds": spread(without),
        }
        if figure != "record":  # next to nothing without history: no ratio to speak of
            figures[figure]["ratio_with_over_without"] = spread(ratios(with_history, without))
            figures[figure]["ratio_of_medians"] = statistics.median(
                with_history
            ) / statistics.median(without)
    return figures


async def run(members: int, rounds: int, hosts: int, calibrating: bool) -> dict[str, Any]:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-history-") as name:
        work = Path(name)
        processes = Processes(work, secrets.token_hex(16))
        fleet = None
        try:
            servers = await asyncio.to_thread(start_hosts, processes, members, hosts)
            spec = FleetSpec(
                members=tuple(member_specs(servers)),
                token=processes.token,
                fan_out=DEFAULT_FAN_OUT,
            )
            fleet = await Fleet.discover(spec)
            timings = await measure(fleet, work, rounds, calibrating)
        finally:
            if fleet is not None:
                await fleet.close()
            processes.close()
    return {
        "benchmark": "history_cost",
        "params": {"members": members, "rounds": rounds, "hosts": hosts, "calibrate": calibrating},
        "figures": report(timings),
        "note": "pause: the checkpoint call until every member answered its Resume; total: "
        "the whole call (with history: its record written); cpu: this process's CPU over "
        "the call; cpu_to_resume: this process's CPU from the call until the fleet's resume "
        "starts (prepare, commit, publish: most of the pause's CPU); record: the call after "
        "the resume and the retention. "
        "ratio_with_over_without: the median of per-round ratios (rounds interleaved, "
        f"order alternating); the goal is <= 1.03. Retention keeps {KEEP}: nothing deleted",
        "loadavg": os.getloadavg(),
        "seconds": round(time.perf_counter() - began, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.history_cost")
    parser.add_argument("--members", type=int, default=1000, help="light members (of 4 kinds)")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds")
    parser.add_argument("--hosts", type=int, default=2, help="processes serving the members")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="both sides without history: the ratios two identical runs show on this machine",
    )
    args = parser.parse_args(argv)
    result = asyncio.run(run(args.members, args.rounds, args.hosts, args.calibrate))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
