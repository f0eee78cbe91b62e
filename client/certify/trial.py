"""One trial: a fresh fleet replaying the baseline's model answers, the collector checkpointing
periodically, one fault at the phase the plan names, recovery by the product's own paths, and
what it all left behind as a `RunObservation`.

The collector pauses itself at the step of the phase (`controller`), so the fault meets the
fleet in exactly that phase however loaded the machine is; a mid-step fault waits until the
plan's fraction of the rollouts is in the output and a checkpoint is published (so the
recovery has something to restore). A phase whose step never came before the run ended is
not reached: nothing was proven, and the trial says so rather than passing.

Phase -> the step the collector pauses at (n: the plan's checkpoint):

* prepare: `preparing@n`; after_snapshot: `committed@n` (synchronous) or `snapshotted@n`
  (asynchronous); background_write: `writing@n`, on a fleet with asynchronous commits (a
  fleet file with `async_commit = false` runs on a derived copy that sets it, and the note
  says so); publication: one of the three publication steps, drawn from the plan;
* restore: `recovery_cut_ended@1` or `recovery_restored@1`, after_resume: `recovered@1`,
  each once `plan.trigger` was SIGKILLed and replaced mid-step (its loss makes the recovery).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import re
import time
from pathlib import Path

from rollout_checkpoint.client.certify.aftermath import (
    RestoreBench,
    continued_episodes,
    restarted_rollouts,
    seconds_until_open,
)
from rollout_checkpoint.client.certify.baseline import run_directory, run_folder
from rollout_checkpoint.client.certify.controller import ControllerProcess
from rollout_checkpoint.client.certify.findings import Phase, TrialPlan
from rollout_checkpoint.client.certify.fleet_processes import FleetProcesses
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.runs import (
    RUN_SECONDS,
    RunFailed,
    collect_args,
    collect_exports,
    dispatched_attempts,
    held_after,
    model_args,
    model_misses,
    new_observation,
    published_ids,
    read_rows,
    untyped_failures,
)
from rollout_checkpoint.client.certify.setup import CertifySetup
from rollout_checkpoint.client.certify.strikes import POLL_SECONDS, Striker
from rollout_checkpoint.client.checkpointing.fanout import FleetError
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    open_checkpoint_root,
)
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import DiscoveryError, FleetSpec, load_fleet_file

PUBLICATION_STEPS = ("after_verify", "after_fleet_manifest", "after_latest")
RESTORE_STEPS = ("recovery_cut_ended", "recovery_restored")
MAX_RECOVERIES = 3
"""The trial collector's `--max-recoveries`."""
KEEP = 100
"""The trial collector's `--keep`: every checkpoint of a trial stays, so each is checked to
restore and each one's scope tells a continued rollout from a restarted one."""
STOPPED_RESUMES = 2
"""How often a collector that stopped with its `--resume` command (exit 5 or 143) is resumed
that way before the trial gives up on it."""
REOPEN_SECONDS_PAST_TIMEOUT = 60.0
"""The reopen deadline is twice `--checkpoint-timeout` (a recovery waits that long for a lost
member to answer, then restores within as long) plus this, for starting replacements and a
stopped member's lease on a loaded machine."""
ASYNC_COMMIT = re.compile(r"^async_commit\s*=\s*false\s*(#.*)?$", re.MULTILINE)


def pause_step(plan: TrialPlan, asynchronous: bool) -> str | None:
    """The `STEP@N` the collector pauses at for the plan's phase (None: mid-step)."""
    n = plan.checkpoint
    draw = int(plan.moment * 1000)  # the plan's own random draw, so `--only` repeats it
    steps = {
        Phase.MID_STEP: None,
        Phase.PREPARE: f"preparing@{n}",
        Phase.AFTER_SNAPSHOT: f"{'snapshotted' if asynchronous else 'committed'}@{n}",
        Phase.BACKGROUND_WRITE: f"writing@{n}",
        Phase.PUBLICATION: f"{PUBLICATION_STEPS[draw % len(PUBLICATION_STEPS)]}@{n}",
        Phase.RESTORE: f"{RESTORE_STEPS[draw % len(RESTORE_STEPS)]}@1",
        Phase.AFTER_RESUME: "recovered@1",
    }
    return steps[plan.phase]


def async_fleet_file(fleet_path: Path) -> Path:
    """A copy of the fleet file with `async_commit = true`, beside it (relative paths in it,
    commands' folders included, keep their meaning), hidden by a leading dot."""
    derived = fleet_path.with_name(f".{fleet_path.stem}.certify-async{fleet_path.suffix}")
    text = fleet_path.read_text()
    if fleet_path.suffix == ".toml":
        if ASYNC_COMMIT.search(text):
            text = ASYNC_COMMIT.sub("async_commit = true", text)
        else:
            text = "async_commit = true\n" + text
    else:
        import yaml

        data = yaml.safe_load(text)
        data["async_commit"] = True
        text = yaml.safe_dump(data, sort_keys=False)
    derived.write_text(text)
    return derived


async def run_trial(
    setup: CertifySetup,
    plan: TrialPlan,
    recording: Path,
    *,
    defer_restore: bool = False,
) -> tuple[RunObservation, bool, str]:
    """Run trial `plan` on a fresh fleet replaying `recording`: (the observation, whether
    the fault's moment came, a one-line note). Everything it started is stopped. Its
    published checkpoints are restored into fresh processes, or with `defer_restore` left to
    the caller (`restore_check` into its bench, once no trial holds the addresses)."""
    label = f"trial {plan.number}"
    directory = await run_directory(setup, label)
    notes: list[str] = []
    fleet_path, spec = setup.fleet_path, setup.spec
    derived: Path | None = None
    if plan.phase is Phase.BACKGROUND_WRITE and not spec.async_commit:
        derived = fleet_path = await asyncio.to_thread(async_fleet_file, setup.fleet_path)
        spec = await asyncio.to_thread(load_fleet_file, derived)
        notes.append("ran on a derived fleet file with async_commit = true")
    try:
        run = TrialRun(setup, plan, recording, directory, fleet_path, spec)
        observation = await run.run()
    finally:
        if derived is not None:
            await asyncio.to_thread(derived.unlink, missing_ok=True)
    if not defer_restore:
        own = RestoreBench(setup.spec, directory / "logs" / "restore", run.extra)
        try:
            await restore_check(own, setup, observation)
        finally:
            await own.close()
    notes += run.striker.notes if run.reached else [f"not reached: {run.unreached}"]
    return observation, run.reached, "; ".join(notes)


async def restore_check(
    bench: RestoreBench, setup: CertifySetup, observation: RunObservation
) -> None:
    """Fill `observation.restore_failures`: the checkpoints its trial published (under its
    run's folder), restored into `bench`."""
    checkpoints = run_folder(setup, observation.label) / "checkpoints"
    root = await asyncio.to_thread(open_checkpoint_root, checkpoints)
    observation.restore_failures = await bench.failures(root, observation.published)


class TrialRun:
    """One trial's run (see the module doc); `run` it once."""

    def __init__(
        self,
        setup: CertifySetup,
        plan: TrialPlan,
        recording: Path,
        directory: Path,
        fleet_path: Path,
        spec: FleetSpec,
    ) -> None:
        self.setup, self.plan, self.directory, self.spec = setup, plan, directory, spec
        self.extra = model_args(setup, "replay", recording)
        self.processes = FleetProcesses(spec, directory / "logs", extra_args=self.extra)
        self.root_path = directory / "checkpoints"
        self.args = collect_args(
            setup,
            directory,
            fleet=fleet_path,
            concurrency=setup.concurrency,
            checkpoint_every=setup.checkpoint_every,
            extra=["--max-recoveries", str(MAX_RECOVERIES), "--keep", str(KEEP)],
        )
        self.controllers: list[ControllerProcess] = []
        self.striker = Striker(
            plan, spec, self.processes, self.root_path, setup.checkpoint_timeout, self._resume
        )
        self.reached = False
        self.unreached = ""
        self.expected = 0
        """How many rollouts the run has to finish."""
        self.reopen_deadline = 2 * setup.checkpoint_timeout + REOPEN_SECONDS_PAST_TIMEOUT

    async def run(self) -> RunObservation:
        observation = await new_observation(self.setup, f"trial {self.plan.number}")
        self.expected = len(observation.expected)
        reopening: asyncio.Task[float | None] | None = None
        try:
            await self.processes.start_all()
            pause = pause_step(self.plan, self.spec.async_commit)
            controller = await self._start(pause_at=pause)
            if await self._moment(controller, pause):
                self.reached = True
                struck = time.monotonic()
                observation.reopen_deadline = self.reopen_deadline  # only a fault is timed
                controller = await self.striker.strike(controller)
                reopening = asyncio.create_task(
                    seconds_until_open(self.spec, struck, struck + self.reopen_deadline)
                )
            codes = await self._finish(controller)
            if reopening is not None:
                observation.reopen_seconds = await reopening
            await self._observe(observation, codes)
        finally:
            if reopening is not None and not reopening.done():
                reopening.cancel()
                await asyncio.gather(reopening, return_exceptions=True)
            for controller in self.controllers:
                controller.kill()
                with contextlib.suppress(TimeoutError):
                    await controller.wait(RUN_SECONDS)
            # SIGKILL, not a graceful stop: all the trial checks was read from the members by
            # now (`_observe`), and draining five servers cost every trial half a second.
            await self.processes.kill_all()
        return observation

    async def _start(
        self, *, pause_at: str | None = None, resume: bool = False
    ) -> ControllerProcess:
        number = len(self.controllers) + 1
        controller = await ControllerProcess.start(
            [*self.args, *(["--resume"] if resume else [])],
            log=self.directory / f"collect.{number}.log",
            pause_at=pause_at,
        )
        self.controllers.append(controller)
        return controller

    async def _resume(self) -> ControllerProcess:
        return await self._start(resume=True)

    async def _moment(self, controller: ControllerProcess, pause: str | None) -> bool:
        """Wait for the fault's moment: the pause (after the trigger's loss, for a recovery
        phase), or the plan's fraction of rollouts finished. False (and why, in `unreached`)
        when the run ended first."""
        if self.plan.phase in (Phase.RESTORE, Phase.AFTER_RESUME):
            if not await self._published_with_rollouts_left(controller, 0.0):
                self.unreached = "the run ended before a checkpoint to recover from"
                return False
            trigger = self.plan.trigger or self.spec.members[0].name
            await self.striker.kill_and_replace([trigger])
            self.striker.notes[-1] = f"SIGKILLed {trigger} to make a recovery"
        if pause is None:
            if await self._published_with_rollouts_left(controller, self.plan.moment):
                return True
            self.unreached = f"the run ended before {self.plan.moment:.0%} of its rollouts"
            return False
        if await controller.reached(RUN_SECONDS):
            return True
        self.unreached = f"the collector never reached {pause} before the run ended"
        return False

    async def _published_with_rollouts_left(
        self, controller: ControllerProcess, fraction: float
    ) -> bool:
        """Until a checkpoint is published and `fraction` of the rollouts are in the output,
        with some still to go (True), or the run ended (False)."""
        output = self.directory / "rollouts.jsonl"
        expected = self.expected
        wanted = math.ceil(fraction * expected)
        deadline = time.monotonic() + RUN_SECONDS
        while controller.process.returncode is None and time.monotonic() < deadline:
            done = len(await read_rows(output))
            latest = await asyncio.to_thread((self.root_path / "LATEST").exists)
            if latest and wanted <= done < expected:
                return True
            if done >= expected:
                return False
            await asyncio.sleep(POLL_SECONDS)
        return False

    async def _finish(self, controller: ControllerProcess) -> list[int]:
        """Wait for the collector; resume one that stopped with its `--resume` command (at
        most `STOPPED_RESUMES` times). Every exit code the product chose (not the kills)."""
        codes: list[int] = []
        while True:
            try:
                code = await controller.wait(RUN_SECONDS)
            except TimeoutError:
                controller.kill()
                await controller.wait()
                raise RunFailed(
                    f"trial {self.plan.number}: the collector hung past {RUN_SECONDS:g} s"
                ) from None
            codes.append(code)
            stopped = code in (ExitCode.UNREACHABLE, ExitCode.TERMINATED)
            if not stopped or len(codes) > STOPPED_RESUMES:
                return codes
            controller = await self._resume()

    async def _observe(self, observation: RunObservation, codes: list[int]) -> None:
        """Fill `observation` from the files and the fleet (still running)."""
        observation.controller_exit = codes[-1] if codes else None
        for controller in self.controllers:
            observation.notes += await controller.notes()
        observation.rows = await read_rows(self.directory / "rollouts.jsonl")
        root = await asyncio.to_thread(open_checkpoint_root, self.root_path)
        observation.published = await published_ids(root)
        continued = await continued_episodes(root, observation.published)
        dispatched = await dispatched_attempts(self.root_path)
        observation.restarted = restarted_rollouts(observation.rows, dispatched, continued)
        observation.sent_before_kill = dict(self.striker.sent_before_kill)
        setup = self.setup
        try:
            observation.exports = await collect_exports(
                dataclasses.replace(setup, spec=self.spec),
                observation.rows,
                self.directory / "exports",
            )
        except (RunFailed, FleetError, ControlError, DiscoveryError, PublicationError) as error:
            observation.notes.append(f"certify: the sessions could not be exported ({error})")
        try:
            observation.held_after = await held_after(self.spec)
        except (FleetError, ControlError, DiscoveryError) as error:
            observation.notes.append(f"certify: the held results could not be listed ({error})")
        observation.model_misses = await model_misses(setup, self.processes)
        observation.untyped = await untyped_failures(
            self.processes, [c.log for c in self.controllers], codes
        )
