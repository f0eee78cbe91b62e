"""`rollout-checkpoint demo`: checkpoint a live fleet mid-flight, SIGKILL it, restore, continue.

Starts a local fleet as separate processes (scripted policy model, agent, environment, the
prompt-injection and counter resources servers), each with its gRPC sidecar on a free loopback
port, and then:

1. runs an uninterrupted baseline of N rollouts and records every trajectory and reward;
2. runs the same rollouts on a fresh fleet and, once a good share is mid-episode, checkpoints
   it (prepare with streaming progress, commit, publish);
3. SIGKILLs every fleet process, starts fresh ones (started closed), restores the published
   checkpoint (all or nothing), takes a second checkpoint of the restored state before any
   replacement starts and checks it exports everything byte for byte as the first did,
   resumes, and continues every unfinished rollout as attempt N+1;
4. reports the numbers and the comparisons with the baseline, and exits non-zero on any
   mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import restore_published
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot, PublishedParticipant
from rollout_checkpoint.client.cli.console import HelpFormatter, epilog
from rollout_checkpoint.client.fleet import Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.core.episodes import EpisodeId

STATE_CHANGES = {
    "update_patient_chart": {"patients"},
    "send_message": {"messages"},
    "prescribe_medication": {"prescriptions"},
    "schedule_appointment": {"appointments"},
    "cancel_appointment": {"appointments"},
    "change_candidate_status": {"candidates"},
    "send_offer": {"offers", "candidates"},
}
"""Which top-level parts of an environment each state-changing tool may touch (plus the id
counters kept in the environment)."""
ID_COUNTERS = "_id_counters"


@dataclass
class Options:
    rollouts: int = 32
    concurrency: int = 24
    checkpoint_after: int = 4
    latency: float = 0.05
    output_dir: Path | None = None
    json: bool = False
    timeout: float = 60.0
    crash_twice: bool = False
    skip_resources_restore: bool = False
    self_heal: bool = False
    victim: str = "policy_model"
    workers: int = 1
    """HTTP worker processes of each resources, agent and environment server (`--workers`)."""
    async_commit: bool = False
    """Commit asynchronously (`--async-commit`): every member answers at its snapshot, the
    parts are awaited (AwaitPart) before publishing; the second checkpoint resumes the fleet
    before its parts are durable."""


@dataclass
class Server:
    name: str
    kind: str
    process: subprocess.Popen[str]
    http: str
    grpc: str
    log: Path
    args: list[str] = field(default_factory=list)
    """What it was started with (`serve` arguments): a replacement reuses them."""


ANNOUNCE_TIMEOUT_SECONDS = 60.0
"""How long a fleet server may take to print its announcement line."""


@dataclass
class FleetProcesses:
    """One generation of the fleet: five processes with sidecars on free loopback ports."""

    label: str
    servers: dict[str, Server] = field(default_factory=dict)

    def spec(self, token: str) -> FleetSpec:
        members = tuple(MemberSpec(s.name, s.grpc) for s in self.servers.values())
        return FleetSpec(members=members, token=token)

    def url(self, name: str) -> str:
        return f"http://{self.servers[name].http}"

    def kill(self) -> None:
        """SIGKILL every server, callers first, each dead before the next is killed.

        Callees started first, so the reverse of the start order kills the environment before
        the agent and the agent before its callees: a caller that outlived its callee would log
        a traceback for the connection it lost, which no real crash of the whole fleet shows."""
        for server in reversed(list(self.servers.values())):
            signal_group(server.process, signal.SIGKILL)
            server.process.wait(timeout=30)

    def stop(self) -> None:
        for server in self.servers.values():
            signal_group(server.process, signal.SIGTERM)
        for server in self.servers.values():
            try:
                server.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                signal_group(server.process, signal.SIGKILL)
                server.process.wait(timeout=10)


def signal_group(process: subprocess.Popen[str], signum: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)


def serve_options(token: str, *, start_closed: bool) -> list[str]:
    """The options every fleet server is started with.

    The token is passed as `--token=VALUE`: a random urlsafe token starts with `-` one time in
    64, and argparse would take `--token -x…` for a missing value followed by an option."""
    return [f"--token={token}", "--log-level", "info"] + (
        ["--start-closed"] if start_closed else []
    )


async def start_fleet(
    label: str, logs: Path, token: str, options: Options, *, start_closed: bool
) -> FleetProcesses:
    """Start the fleet callee-first: every server's address is known before its caller starts."""
    fleet = FleetProcesses(label)
    common = serve_options(token, start_closed=start_closed)
    # Several workers per resources and environment server: still one participant each.
    workers = ["--workers", str(options.workers)] if options.workers > 1 else []
    first = await asyncio.gather(
        _start(
            fleet, logs, "prompt_injection", "resources", ["prompt_injection", *workers, *common]
        ),
        _start(fleet, logs, "counter", "resources", ["counter", *workers, *common]),
        _start(
            fleet,
            logs,
            "policy_model",
            "model",
            ["policy_model", "--latency", str(options.latency), *common],
        ),
    )
    del first
    await _start(
        fleet,
        logs,
        "agent",
        "agent",
        [
            "agent",
            "--model-url",
            fleet.url("policy_model"),
            "--resources",
            f"prompt_injection={fleet.url('prompt_injection')}",
            "--resources",
            f"counter={fleet.url('counter')}",
            *workers,
            *common,
        ],
    )
    await _start(
        fleet,
        logs,
        "environment",
        "environment",
        ["environment", "--agent-url", fleet.url("agent"), *workers, *common],
    )
    return fleet


async def _start(fleet: FleetProcesses, logs: Path, name: str, kind: str, args: list[str]) -> None:
    fleet.servers[name] = await asyncio.to_thread(
        launch_server, fleet.label, logs, name, kind, args
    )


def launch_server(label: str, logs: Path, name: str, kind: str, args: list[str]) -> Server:
    """Start one server in its own process group and read the line it prints once it listens."""
    log = logs / f"{label}-{name}.log"
    command = [sys.executable, "-m", "rollout_checkpoint.examples.serve", *args]
    process, announced = start_announcing(command, name, log)
    return Server(name, kind, process, announced["http"], announced["grpc"], log, args)


def start_announcing(
    command: list[str], name: str, log: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start `command` in its own process group (stderr to `log`) and read the JSON line it
    prints once it listens. Bounded: a process that never announces itself must fail the
    demo, not hang it."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            env=dict(os.environ, GRPC_VERBOSITY="ERROR"),
        )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], ANNOUNCE_TIMEOUT_SECONDS)
    line = process.stdout.readline() if ready else ""
    if not line:
        signal_group(process, signal.SIGKILL)
        raise RuntimeError(
            f"{name} did not start within {ANNOUNCE_TIMEOUT_SECONDS:g} s "
            f"(exit {process.wait()}); see {log}"
        )
    announced: dict[str, Any] = json.loads(line)
    return process, announced


# -- rollouts -------------------------------------------------------------------------------


@dataclass
class Rollout:
    rollout_id: str
    task: dict[str, Any]
    reply: dict[str, Any] | None = None
    attempt: int = 0
    dispatched: bool = False
    error: str | None = None


def make_rollouts(count: int) -> list[Rollout]:
    tasks = load_tasks()
    return [Rollout(f"r{i:03d}", tasks[i % len(tasks)]) for i in range(count)]


async def run_one(client: httpx.AsyncClient, env_url: str, rollout: Rollout) -> None:
    key = EpisodeId(rollout.rollout_id, rollout.attempt).capture_key
    rollout.dispatched = True
    try:
        response = await client.post(f"{env_url}/ng-rollout/{key}/run", json={"task": rollout.task})
    except httpx.HTTPError as error:
        rollout.error = f"{type(error).__name__}"
        return
    if response.status_code != 200:
        rollout.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return
    rollout.reply = response.json()


async def run_all(env_url: str, rollouts: list[Rollout], concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def guarded(rollout: Rollout) -> None:
            async with limit:
                await run_one(client, env_url, rollout)

        await asyncio.gather(*(guarded(r) for r in rollouts))


# -- the demo -------------------------------------------------------------------------------


@dataclass
class Report:
    numbers: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, problem: str = "") -> None:
        self.checks[name] = self.checks.get(name, True) and ok
        if not ok and problem:
            self.problems.append(f"{name}: {problem}")

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


class Demo:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.console = Console(stderr=True, quiet=options.json)
        self.token = secrets.token_urlsafe(24)
        self.report = Report()
        self.fleets: list[FleetProcesses] = []

    def say(self, text: str) -> None:
        self.console.print(text)

    async def run(self, work: Path) -> Report:
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        root = CheckpointRoot(work / "checkpoints")
        try:
            baseline = await self.baseline(logs)
            if self.options.self_heal:
                from rollout_checkpoint.examples.self_heal import SelfHealDemo

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
        client = httpx.AsyncClient(timeout=httpx.Timeout(300.0))

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

    async def take_checkpoint(
        self, processes: FleetProcesses, root: CheckpointRoot, rollouts: list[Rollout]
    ) -> dict[str, Any]:
        deadline = time.time() + self.options.timeout
        checkpoint_id = root.new_checkpoint_id()
        async with await Fleet.discover(processes.spec(self.token)) as fleet:
            started = time.monotonic()
            last = None
            async for progress in fanout.prepare(fleet, checkpoint_id, deadline):
                last = progress
                states = " ".join(
                    f"{m.name}:{_state(m.state) if m.reached else '-'}({m.readiness.blocker_count})"
                    for m in progress.members
                )
                self.say(
                    f"   prepare #{progress.sequence} {progress.elapsed * 1000:.1f} ms  {states}"
                )
            assert last is not None
            self.report.numbers["prepare_ms"] = round((time.monotonic() - started) * 1000, 2)
            if not last.prepared:
                raise DemoFailed(
                    f"the fleet did not get prepared: {last.outcome}, blockers {last.blockers()}"
                )
            agent = next(m for m in last.members if m.name == "agent")
            self.report.numbers["episodes_parked_at_boundary"] = agent.readiness.counts.get(
                "parked", 0
            )
            in_flight = await self.fix_scope(fleet, rollouts)
            commit_started = time.monotonic()
            directory = root.directory(checkpoint_id)
            result = await fanout.commit(
                fleet,
                checkpoint_id,
                deadline,
                str(directory),
                in_flight,
                asynchronous=self.options.async_commit,
            )
            self.report.numbers["commit_ms"] = round((time.monotonic() - commit_started) * 1000, 2)
            if self.options.async_commit:
                # The fleet is killed next, so it stays closed; the parts are awaited here.
                durable_started = time.monotonic()
                result = await fanout.await_parts(fleet, checkpoint_id, result, deadline)
                self.report.numbers["durable_ms"] = round(
                    (time.monotonic() - durable_started) * 1000, 2
                )
            parts = [
                PublishedParticipant(
                    m.name, m.kind_name, m.instance, result.members[m.name].manifest_sha256
                )
                for m in fleet.members
            ]
            published = await asyncio.to_thread(
                root.publish, checkpoint_id, parts, in_flight, b"", keep=2
            )
            self.report.numbers["in_flight_at_checkpoint"] = len(in_flight)
            self.report.numbers["sessions_exported"] = len(
                result.members["prompt_injection"].exported
            ) + len(result.members["counter"].exported)
            self.report.numbers["records"] = result.record_count()
            self.report.numbers["bytes"] = result.bytes()
            self.say(
                f"   committed and published {checkpoint_id}: {len(in_flight)} rollouts in flight, "
                f"{result.record_count()} records, {result.bytes()} bytes"
            )
            return {"id": checkpoint_id, "directory": published.directory, "scope": in_flight}

    async def fix_scope(self, fleet: Fleet, rollouts: list[Rollout]) -> list[EpisodeId]:
        """Every dispatched rollout without a reply: a reply already on the wire for an episode
        the environment no longer holds is awaited first, so it is neither lost nor redone."""
        environment = fleet.member("environment")
        for _ in range(200):
            held = {e.capture_key for e in await environment.client.all_episodes()}
            on_wire = [
                r
                for r in rollouts
                if r.dispatched and r.reply is None and r.error is None and r.rollout_id not in held
            ]
            if not on_wire:
                break
            await asyncio.sleep(0.01)
        return sorted(EpisodeId(r.rollout_id) for r in rollouts if r.dispatched and r.reply is None)

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
        continued = await self.restore_into(fleet_processes, root, "restore-1", timed=True)
        attempt = 1
        async with await Fleet.discover(fleet_processes.spec(self.token)) as fleet:
            await self.second_checkpoint(fleet, root, first, continued)
        if self.options.crash_twice:
            self.say(
                "[bold]   SIGKILL again[/] before any replacement started; restore the second checkpoint"
            )
            fleet_processes.kill()
            self.fleets.remove(fleet_processes)
            fleet_processes = await self.start(logs, "restored-again", start_closed=True)
            await self.restore_into(fleet_processes, root, "restore-2")
            attempt = 2
        in_scope = {e.rollout_id for e in continued}
        for rollout in rollouts:
            if rollout.rollout_id in in_scope:
                rollout.attempt = attempt
        remaining = [r for r in rollouts if r.reply is None]
        for rollout in remaining:
            rollout.error = None
            rollout.dispatched = False
        finished_during = _finished_during_the_cut(first, in_scope)
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

    async def restore_into(
        self,
        processes: FleetProcesses,
        root: CheckpointRoot,
        restore_id: str,
        *,
        timed: bool = False,
    ) -> tuple[EpisodeId, ...]:
        """Restore LATEST into fresh processes (all or nothing) and resume them."""
        deadline = time.time() + self.options.timeout
        async with await Fleet.discover(processes.spec(self.token)) as fleet:
            target = fleet
            if self.options.skip_resources_restore:
                # Negative control: without the resources' state the continuation cannot match.
                target = Fleet(fleet.spec, [m for m in fleet.members if m.kind_name != "resources"])
            started = time.monotonic()
            restored = await restore_published(target, root, restore_id, deadline)
            if timed:
                self.report.numbers["restore_ms"] = round((time.monotonic() - started) * 1000, 2)
            await fanout.resume(fleet, restore_id, deadline)
            return restored.continued

    async def second_checkpoint(
        self,
        fleet: Fleet,
        root: CheckpointRoot,
        first: dict[str, Any],
        continued: Iterable[EpisodeId],
    ) -> None:
        """A checkpoint of the restored state, before any replacement starts: it must export
        every restored session and boundary byte for byte as the first did (under N+1)."""
        scope = sorted(e.next_attempt() for e in continued)
        deadline = time.time() + self.options.timeout
        checkpoint_id = root.new_checkpoint_id()
        last = await fanout.prepare_until_done(fleet, checkpoint_id, deadline)
        if not last.prepared:
            raise DemoFailed(f"the restored fleet did not get prepared: {last.blockers()}")
        directory = root.directory(checkpoint_id)
        result = await fanout.commit(
            fleet,
            checkpoint_id,
            deadline,
            str(directory),
            scope,
            asynchronous=self.options.async_commit,
        )
        if self.options.async_commit:
            # Resume first, then await the parts: the restored fleet may move on while they
            # are written, and the parts must still hold the state of the cut, byte for byte.
            await fanout.resume(fleet, checkpoint_id, deadline)
            result = await fanout.await_parts(fleet, checkpoint_id, result, deadline)
        if self.options.crash_twice:
            parts = [
                PublishedParticipant(
                    m.name, m.kind_name, m.instance, result.members[m.name].manifest_sha256
                )
                for m in fleet.members
            ]
            await asyncio.to_thread(root.publish, checkpoint_id, parts, scope, b"", keep=2)
        if not self.options.async_commit:
            await fanout.resume(fleet, checkpoint_id, deadline)
        mismatches = []
        for part in (Path(first["directory"]) / "participants").glob("*/*"):
            before = _records_by_rollout(part)
            after = _records_by_rollout(directory / "participants" / part.parent.name / part.name)
            if before != after:
                mismatches.append(f"{part.parent.name}/{part.name}")
        self.report.check(
            "second_checkpoint_matches_first", not mismatches, f"parts differ: {mismatches}"
        )
        if not self.options.crash_twice:
            shutil.rmtree(directory, ignore_errors=True)

    def compare(
        self,
        first: dict[str, Any],
        rollouts: list[Rollout],
        baseline: dict[str, Rollout],
        in_scope: set[str],
        attempt: int,
    ) -> None:
        report = self.report
        check_trajectories(report, rollouts, baseline)
        rewards = [float(r.reply.get("reward") or 0.0) for r in rollouts if r.reply is not None]
        base_rewards = [float((b.reply or {}).get("reward") or 0.0) for b in baseline.values()]
        report.numbers["mean_reward"] = round(statistics.fmean(rewards), 6) if rewards else None
        report.numbers["baseline_mean_reward"] = (
            round(statistics.fmean(base_rewards), 6) if base_rewards else None
        )
        report.check(
            "mean_reward_equals_baseline",
            bool(rewards)
            and report.numbers["mean_reward"] == report.numbers["baseline_mean_reward"],
            "mean rewards differ",
        )
        agent_records = _records_by_rollout(
            Path(first["directory"]) / "participants" / "agent" / "agent"
        )
        prefix_problems = []
        restarted = []
        finished_during = 0
        for rollout in rollouts:
            if rollout.rollout_id not in in_scope or rollout.reply is None:
                continue
            boundary = json.loads(agent_records.get(rollout.rollout_id, "{}")).get("boundary")
            if boundary is None:
                restarted.append(rollout.rollout_id)
                continue
            if "done" in boundary:  # finished while the fleet was being cut: its reply was carried
                finished_during += 1
                relayed = {
                    k: v
                    for k, v in rollout.reply.items()
                    if k not in ("environment", "task_digest")
                }
                if relayed != boundary["done"]:
                    prefix_problems.append(f"{rollout.rollout_id}(carried reply differs)")
                continue
            checkpointed = boundary["messages"]
            if rollout.reply.get("messages", [])[: len(checkpointed)] != checkpointed:
                prefix_problems.append(rollout.rollout_id)
            if (
                rollout.reply.get("attempt") != attempt
                or rollout.reply.get("continued_from_step") != boundary["step"]
            ):
                prefix_problems.append(f"{rollout.rollout_id}(not continued)")
        report.numbers["finished_during_checkpoint"] = finished_during
        report.numbers["continued"] = len(in_scope) - len(restarted) - finished_during
        report.numbers["restarted"] = len(restarted)
        report.numbers["retired"] = 0
        report.check("continued_from_checkpointed_calls", not prefix_problems, f"{prefix_problems}")
        report.check("no_restarts", not restarted, f"restarted from input: {restarted}")
        self.check_exports(first, rollouts, agent_records)

    def check_exports(
        self, first: dict[str, Any], rollouts: list[Rollout], agent_records: dict[str, str]
    ) -> None:
        tasks = {r.rollout_id: r.task for r in rollouts}
        exports = _records_by_rollout(
            Path(first["directory"]) / "participants" / "resources" / "prompt_injection"
        )
        problems = []
        for rollout_id, raw in exports.items():
            environment = json.loads(raw)["state"]["environment"]
            seeded = tasks[rollout_id]["environment"]
            boundary = json.loads(agent_records.get(rollout_id, "{}")).get("boundary") or {}
            called = {c["name"] for c in boundary.get("function_calls", [])}
            allowed = set().union(*(STATE_CHANGES.get(name, set()) for name in called)) | (
                {ID_COUNTERS} if called & set(STATE_CHANGES) else set()
            )
            changed = {
                k for k in set(environment) | set(seeded) if environment.get(k) != seeded.get(k)
            }
            if not changed <= allowed:
                problems.append(
                    f"{rollout_id}: {sorted(changed - allowed)} changed without a call that changes them"
                )
            if not _order_kept(seeded, environment):
                problems.append(f"{rollout_id}: the seeded key order was not kept")
        self.report.numbers["environments_checked"] = len(exports)
        self.report.check(
            "exports_differ_only_where_state_changed", not problems, "; ".join(problems[:5])
        )

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


class DemoFailed(Exception):
    pass


def _state(state: int) -> str:
    return {1: "IDLE", 2: "PREPARING", 3: "PREPARED", 4: "COMMITTED", 5: "RESTORED"}.get(state, "?")


def _finished_during_the_cut(first: dict[str, Any], in_scope: set[str]) -> int:
    """Rollouts in scope that the agent's boundary records as done: they finished while the
    fleet was being cut, so they are answered from the checkpoint, not continued."""
    agent_records = _records_by_rollout(
        Path(first["directory"]) / "participants" / "agent" / "agent"
    )
    return sum(
        1
        for rollout_id in in_scope
        if "done" in (json.loads(agent_records.get(rollout_id, "{}")).get("boundary") or {})
    )


def _records_by_rollout(part: Path) -> dict[str, str]:
    """rollout id -> the record without its episode id, as canonical text (order kept)."""
    records: dict[str, str] = {}
    for path in part.glob("records-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            episode = record.pop("episode_id")
            records[episode["rollout_id"]] = json.dumps(record, ensure_ascii=False)
    return records


def check_trajectories(
    report: Report, rollouts: list[Rollout], baseline: dict[str, Rollout]
) -> None:
    """Every rollout got a reply, and each reply's trajectory equals the baseline's."""
    failed = [r.rollout_id for r in rollouts if r.reply is None]
    report.check("every_rollout_finished", not failed, f"no reply for {failed}")
    differing = [
        r.rollout_id
        for r in rollouts
        if r.reply is not None
        and _trajectory(r.reply) != _trajectory(baseline[r.rollout_id].reply or {})
    ]
    report.check(
        "trajectories_equal_baseline", not differing, f"differ from the baseline: {differing}"
    )


def _trajectory(reply: dict[str, Any]) -> Any:
    """What must equal the baseline: every message (tool calls, arguments, outputs) and the
    verification, without the fields that name the attempt."""
    verify = {k: v for k, v in (reply.get("verify") or {}).items()}
    return {
        "messages": reply.get("messages"),
        "function_calls": reply.get("function_calls"),
        "verify": verify,
        "reward": reply.get("reward"),
    }


def _order_kept(seeded: Any, exported: Any) -> bool:
    if isinstance(seeded, dict) and isinstance(exported, dict):
        common = [k for k in exported if k in seeded]
        if common != [k for k in seeded if k in exported]:
            return False
        return all(_order_kept(seeded[k], exported[k]) for k in common)
    if isinstance(seeded, list) and isinstance(exported, list):
        return all(_order_kept(a, b) for a, b in zip(seeded, exported, strict=False))
    return True


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="rollout-checkpoint demo",
        description=__doc__.split("\n\n")[0],
        epilog=epilog(
            "rollout-checkpoint demo --rollouts 32 --checkpoint-after 4 --output-dir /tmp/demo",
            "exit 1 means a check failed (the report names it).",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts to run (default 32)")
    parser.add_argument(
        "--concurrency", type=int, default=24, help="rollouts in flight at once (default 24)"
    )
    parser.add_argument(
        "--checkpoint-after",
        type=int,
        default=None,
        help="checkpoint once this many have finished (default: an eighth of --rollouts; at "
        "most --rollouts - 1)",
    )
    parser.add_argument(
        "--latency", type=float, default=0.05, help="seconds per scripted model call (default 0.05)"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="keep checkpoints, logs and the report here"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--crash-twice",
        action="store_true",
        help="crash the restored fleet again before it resumes work; continue as attempt N+2",
    )
    parser.add_argument(
        "--skip-resources-restore",
        action="store_true",
        help="negative control: restore every member but the resources servers (the demo must then fail)",
    )
    parser.add_argument(
        "--self-heal",
        action="store_true",
        help="instead: run the fleet under `coordinator --supervise`, SIGKILL one member "
        "mid-flight and watch the supervisor restore and reopen the fleet by itself",
    )
    parser.add_argument(
        "--victim",
        default="policy_model",
        choices=["policy_model", "agent", "environment", "prompt_injection", "counter"],
        help="with --self-heal: the member to kill (default policy_model)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HTTP worker processes per resources, agent and environment server (default 1)",
    )
    parser.add_argument(
        "--async-commit",
        action="store_true",
        help="commit asynchronously: members answer at their snapshot and write their parts "
        "in the background; the demo publishes once every part is durable",
    )
    args = parser.parse_args(argv)
    if args.rollouts < 2 or args.concurrency < 1:
        parser.error("--rollouts must be at least 2 and --concurrency at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    checkpoint_after = (
        args.checkpoint_after if args.checkpoint_after is not None else max(1, args.rollouts // 8)
    )
    return Options(
        args.rollouts,
        args.concurrency,
        min(checkpoint_after, args.rollouts - 1),
        args.latency,
        args.output_dir,
        args.json,
        crash_twice=args.crash_twice,
        skip_resources_restore=args.skip_resources_restore,
        self_heal=args.self_heal,
        victim=args.victim,
        workers=args.workers,
        async_commit=args.async_commit,
    )


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    keep = options.output_dir is not None
    work = options.output_dir or Path(tempfile.mkdtemp(prefix="rollout-checkpoint-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    demo = Demo(options)
    started = time.monotonic()
    try:
        report = asyncio.run(demo.run(work))
    except DemoFailed as failure:
        report = demo.report
        report.check("demo_completed", False, str(failure))
    report.numbers["total_seconds"] = round(time.monotonic() - started, 2)
    payload = {
        "passed": report.passed,
        "numbers": report.numbers,
        "checks": report.checks,
        "problems": report.problems,
    }
    (work / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    if options.json:
        print(json.dumps(payload, sort_keys=True))
    else:
        _print_report(
            demo.console if not options.json else Console(), payload, work if keep else None
        )
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report.passed else 1


def _print_report(console: Console, payload: dict[str, Any], kept: Path | None) -> None:
    console.print()
    for name, value in payload["numbers"].items():
        console.print(f"  {name:32} {value}")
    console.print()
    for name, ok in payload["checks"].items():
        console.print(f"  {'[green]ok[/]' if ok else '[red]FAIL[/]'}  {name}")
    for problem in payload["problems"]:
        console.print(f"  [red]{problem}[/]")
    console.print(
        f"\n{'[green]PASSED[/]' if payload['passed'] else '[red]FAILED[/]'}"
        + (f" (kept in {kept})" if kept else "")
    )


if __name__ == "__main__":
    # Run the importable module's `main`, not this `__main__` copy: `self_heal` imports
    # `rollout_checkpoint.examples.demo`, and a `DemoFailed` it raises must be the class
    # `main` catches (a second copy of the module has a second class).
    from rollout_checkpoint.examples import demo

    sys.exit(demo.main())
