"""One uninterrupted run of every task: what every trial is compared with.

A fresh fleet (the policy model recording, or replaying the recording), the collector without
a pause and without periodic checkpoints, which must exit 0 when recording: a baseline that
failed a rollout cannot tell a trial's loss from its own (`accepted_exits`). Then certify's own scoped checkpoint of the sessions
(`runs.collect_exports`) and the replay's misses. The fleet is always closed, whatever
happened: the next run needs its ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

from rollout_checkpoint.client.certify.controller import ControllerProcess
from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.runs import (
    RUN_SECONDS,
    Mode,
    RunFailed,
    collect_args,
    collect_exports,
    held_after,
    model_args,
    model_misses,
    new_observation,
    read_rows,
    untyped_failures,
)
from rollout_checkpoint.client.certify.setup import CertifySetup
from rollout_checkpoint.client.cli.console import ExitCode

NOTES_IN_ERROR = 5
"""How many of the collector's last notes a failed baseline's message carries."""


def run_folder(setup: CertifySetup, label: str) -> Path:
    """Where the run labelled `label` keeps its files (`trial 3` -> `trial-3`)."""
    return setup.work / label.replace(" ", "-")


async def run_directory(setup: CertifySetup, label: str) -> Path:
    """The empty folder of one run under the work area (`trial 3` -> `trial-3`). What an
    earlier run of the same label left (`--only 3` again) is removed: `collect` refuses to
    start over an old collection, and an old log would be read as this run's."""
    directory = run_folder(setup, label)
    await asyncio.to_thread(shutil.rmtree, directory, ignore_errors=True)
    await asyncio.to_thread(directory.mkdir, parents=True)
    return directory


def accepted_exits(mode: Mode) -> set[int]:
    """The collector's exit codes a baseline goes on with. Recording: 0 only (a rollout that
    failed in the baseline has nothing to be compared with). Replaying (the second pass):
    also 1, rollouts recorded as failed, which is how a server that made the agent ask
    something new shows (the model refused the call `not_in_recording`): that is the
    nondeterminism the second pass exists to find, not a reason to stop."""
    if mode == "record":
        return {ExitCode.OK}
    return {ExitCode.OK, ExitCode.FAILURES_RECORDED}


async def run_baseline(
    setup: CertifySetup, *, recording: Path, mode: Mode, concurrency: int, label: str
) -> RunObservation:
    """Run every task once through a fresh fleet whose policy model records to (`record`) or
    replays from (`replay`) `recording`; `RunFailed` when the collector's exit code is not
    one of `accepted_exits(mode)`.
    `MemberNotStarted` when a member's command does not come up."""
    directory = await run_directory(setup, label)
    observation = await new_observation(setup, label)
    processes = FleetProcesses(
        setup.spec, directory / "logs", extra_args=model_args(setup, mode, recording)
    )
    controller: ControllerProcess | None = None
    try:
        await processes.start_all()
        controller = await ControllerProcess.start(
            collect_args(setup, directory, concurrency=concurrency, checkpoint_every=None),
            log=directory / "collect.log",
        )
        try:
            code = await controller.wait(RUN_SECONDS)
        except TimeoutError:
            raise RunFailed(
                f"{label}: the collector did not finish within {RUN_SECONDS:g} s"
            ) from None
        observation.controller_exit = code
        observation.notes = await controller.notes()
        observation.rows = await read_rows(directory / "rollouts.jsonl")
        if code not in accepted_exits(mode):
            last = "; ".join(observation.notes[-NOTES_IN_ERROR:])
            raise RunFailed(f"{label}: the collector exited {code}: {last}")
        observation.exports = await collect_exports(setup, observation.rows, directory / "exports")
        observation.held_after = await held_after(setup.spec)
        if mode == "replay":
            observation.model_misses = await model_misses(setup, processes)
        observation.untyped = await untyped_failures(processes, [directory / "collect.log"], [code])
        return observation
    finally:
        if controller is not None:
            controller.kill()
            with contextlib.suppress(TimeoutError):
                await controller.wait(RUN_SECONDS)
        await processes.close()
