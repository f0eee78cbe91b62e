"""The demo's four steps in order: baseline, interrupted run, restore and continue, compare.

Only the order and the rollouts' traffic live here; what a step does to the fleet through the
controller library is in `checkpoints`, and how the outcome is judged in `comparison`, so the
tour reads as the four steps the getting-started page describes (docs/getting-started.md,
"The demo").
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from rollout_checkpoint.client import CheckpointRoot, Fleet
from rollout_checkpoint.server.core.keep_alive import client_limits

from .checkpoints import CheckpointSteps
from .comparison import compare_with_baseline, finished_during_the_cut
from .fleet import FleetProcesses, start_fleet
from .options import Options
from .report import Report
from .rollouts import Rollout, make_rollouts, run_all, run_one


class Demo:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.console = Console(stderr=True, quiet=options.json)
        self.token = secrets.token_urlsafe(24)
        self.report = Report()
        self.fleets: list[FleetProcesses] = []
        self.checkpoints = CheckpointSteps(options, self.token, self.report, self.say)

    def say(self, text: str) -> None:
        self.console.print(text)

    async def run(self, work: Path) -> Report:
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        root = CheckpointRoot(work / "checkpoints")
        try:
            baseline = await self.baseline(logs)
            if self.options.self_heal:
                from ..self_heal import SelfHealDemo

                healing = SelfHealDemo(self.options, self.options.victim, self.say, self.token)
                healing.report = self.report
                await healing.run(work, baseline)
            else:
                first, survivors = await self.interrupted_run(logs, root)
                await self.restore_and_continue(logs, root, first, survivors, baseline)
        finally:
            for fleet in self.fleets:
                fleet.stop()
        self.check_logs(logs)
        return self.report

    async def baseline(self, logs: Path) -> dict[str, Rollout]:
        self.say(f"[bold]1/4 baseline[/]: {self.options.rollouts} rollouts, uninterrupted")
        fleet = await self.start(logs, "baseline", start_closed=False)
        rollouts = make_rollouts(self.options.rollouts)
        started = time.monotonic()
        await run_all(fleet.url("environment"), rollouts, self.options.concurrency)
        self.report.numbers["baseline_seconds"] = round(time.monotonic() - started, 3)
        failed = [r.rollout_id for r in rollouts if r.reply is None]
        self.report.check("baseline_completed", not failed, f"rollouts failed: {failed}")
        fleet.stop()
        self.fleets.remove(fleet)
        return {r.rollout_id: r for r in rollouts}

    async def interrupted_run(
        self, logs: Path, root: CheckpointRoot
    ) -> tuple[dict[str, Any], list[Rollout]]:
        options = self.options
        self.say(
            f"[bold]2/4 the same rollouts, checkpointed mid-flight[/] after {options.checkpoint_after} have finished"
        )
        fleet = await self.start(logs, "first", start_closed=False)
        rollouts = make_rollouts(options.rollouts)
        limit = asyncio.Semaphore(options.concurrency)
        finished = asyncio.Event()
        gate = asyncio.Event()
        gate.set()
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=client_limits())

        async def guarded(rollout: Rollout) -> None:
            async with limit:
                await gate.wait()  # during a checkpoint no new rollout is dispatched
                await run_one(client, fleet.url("environment"), rollout)
                if sum(r.reply is not None for r in rollouts) >= options.checkpoint_after:
                    finished.set()

        tasks = [asyncio.ensure_future(guarded(r)) for r in rollouts]
        # The cut comes once `checkpoint_after` rollouts finished (or, if too many failed for
        # that, once every rollout ended): not when the first rollout task ends.
        waiters = [
            asyncio.ensure_future(finished.wait()),
            asyncio.ensure_future(asyncio.wait(tasks)),
        ]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        gate.clear()
        self.report.numbers["finished_when_the_cut_began"] = sum(
            r.reply is not None for r in rollouts
        )
        checkpoint = await self.take_checkpoint(fleet, root, rollouts)
        self.say("[bold]   SIGKILL[/] every fleet process")
        fleet.kill()
        self.fleets.remove(fleet)
        for task in tasks:
            task.cancel()  # rollouts still waiting for the dispatch gate, and replies that died
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        done_before = [r for r in rollouts if r.reply is not None]
        self.report.numbers["finished_before_checkpoint"] = len(done_before)
        self.report.numbers["not_started_at_checkpoint"] = sum(not r.dispatched for r in rollouts)
        return checkpoint, rollouts

    async def restore_and_continue(
        self,
        logs: Path,
        root: CheckpointRoot,
        first: dict[str, Any],
        rollouts: list[Rollout],
        baseline: dict[str, Rollout],
    ) -> None:
        self.say(
            "[bold]3/4 fresh processes[/] (started closed): restore, verify, resume, continue as attempt N+1"
        )
        fleet_processes = await self.start(logs, "restored", start_closed=True)
        continued = await self.checkpoints.restore_into(
            fleet_processes, root, "restore-1", timed=True
        )
        attempt = 1
        async with await Fleet.discover(fleet_processes.spec(self.token)) as fleet:
            await self.checkpoints.second_checkpoint(fleet, root, first, continued)
        if self.options.crash_twice:
            self.say(
                "[bold]   SIGKILL again[/] before any replacement started; restore the second checkpoint"
            )
            fleet_processes.kill()
            self.fleets.remove(fleet_processes)
            fleet_processes = await self.start(logs, "restored-again", start_closed=True)
            await self.checkpoints.restore_into(fleet_processes, root, "restore-2")
            attempt = 2
        in_scope = {e.rollout_id for e in continued}
        for rollout in rollouts:
            if rollout.rollout_id in in_scope:
                rollout.attempt = attempt
        remaining = [r for r in rollouts if r.reply is None]
        for rollout in remaining:
            rollout.error = None
            rollout.dispatched = False
        finished_during = finished_during_the_cut(first, in_scope)
        self.say(
            f"   continuing {len(in_scope) - finished_during} rollouts as attempt {attempt}"
            + (
                f" ({finished_during} more finished while the fleet was cut: their replies were "
                "carried in the checkpoint)"
                if finished_during
                else ""
            )
            + f", starting {len(remaining) - len(in_scope)} not yet run"
        )
        await run_all(fleet_processes.url("environment"), remaining, self.options.concurrency)
        self.say("[bold]4/4 compare with the baseline[/]")
        self.compare(first, rollouts, baseline, in_scope, attempt)
        trajectories = {
            r.rollout_id: {"baseline": baseline[r.rollout_id].reply, "continued": r.reply}
            for r in rollouts
        }
        (logs.parent / "trajectories.json").write_text(json.dumps(trajectories, indent=1) + "\n")

    def check_logs(self, logs: Path) -> None:
        tracebacks = [
            p.name for p in logs.glob("*.log") if "Traceback" in p.read_text(errors="replace")
        ]
        self.report.check(
            "no_traceback_in_server_logs", not tracebacks, f"tracebacks in {tracebacks}"
        )

    async def start(self, logs: Path, label: str, *, start_closed: bool) -> FleetProcesses:
        fleet = await start_fleet(label, logs, self.token, self.options, start_closed=start_closed)
        self.fleets.append(fleet)
        return fleet

    async def take_checkpoint(
        self, processes: FleetProcesses, root: CheckpointRoot, rollouts: list[Rollout]
    ) -> dict[str, Any]:
        """Checkpoint the fleet `processes` run (`CheckpointSteps.take_checkpoint`)."""
        return await self.checkpoints.take_checkpoint(processes, root, rollouts)

    def compare(
        self,
        first: dict[str, Any],
        rollouts: list[Rollout],
        baseline: dict[str, Rollout],
        in_scope: set[str],
        attempt: int,
    ) -> None:
        """Record in the report how the continued run compares with the baseline."""
        compare_with_baseline(self.report, first, rollouts, baseline, in_scope, attempt)
