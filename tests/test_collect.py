"""`rollout-checkpoint collect` against real fleets of example-server processes.

Every collection here is the CLI as a subprocess in its own process group, driving a real
fleet (scripted policy model, agent, environment, resources servers) over HTTP and gRPC. A
crash is a real SIGKILL; a "fresh fleet" is new processes started closed. Waiting for a
state of those external processes is bounded polling of the files they write.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from rollout_checkpoint.client.checkpointing.publication.history import open_history
from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect import CorruptFile, read_jsonl
from rollout_checkpoint.client.collect.groups import GroupWriter
from rollout_checkpoint.client.collect.inputs import TaskRow
from rollout_checkpoint.client.collect.journal import DurableAppender
from rollout_checkpoint.client.collect.outcome import Outcome, classify
from rollout_checkpoint.client.collect.rollouts import Rollout, RolloutBook, controller_state
from rollout_checkpoint.client.collect.staleness import StaleHandling
from rollout_checkpoint.client.collect.view import CollectView, Counts
from rollout_checkpoint.client.ledger import ResultLedger
from rollout_checkpoint.client.staleness import Stale, StalenessPolicy
from rollout_checkpoint.examples.demo import FleetProcesses, Options, start_fleet
from rollout_checkpoint.examples.policy_model import ScriptedPolicy
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .doc_pages import commands
from .doc_steps import differences, steps

DOC_SECTIONS = [("docs/operations.md", "A collection in one shell")]
PAGE_SECONDS = 300
REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "examples" / "prompt_injection_tasks.jsonl"
TOKEN = "collect-test-token"
ENV = dict(os.environ, COLLECT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
CRASHING_CLI = [sys.executable, "-m", "tests.collect_crash"]
"""`collect` with a crash point injected (run from the repository root)."""
REPEATS = 3
CONCURRENCY = 6
LATENCY = 0.15
"""Seconds per scripted model call: a rollout takes about a second, long enough to be cut."""
OPEN_FLEETS, CLOSED_FLEETS = 19, 8
"""The fleets this module takes (open, and started closed): the pool boots no more."""


@dataclass
class RealFleet:
    processes: FleetProcesses
    file: Path
    entry: str

    def kill(self) -> None:
        self.processes.kill()


class FleetPool:
    """Boots fleets in the background, one of each kind ahead of demand, so a test's fleets
    start while the test before it runs (booting five servers is most of a test's time)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.executor = ThreadPoolExecutor(max_workers=2)
        self.started: list[RealFleet] = []
        self.ahead: dict[bool, list[Future[RealFleet]]] = {False: [], True: []}
        self.left = {False: OPEN_FLEETS, True: CLOSED_FLEETS}
        self.count = 0
        for closed in (False, True):
            self.ahead[closed].append(self._submit(closed))

    def take(
        self, *, closed: bool, workers: int = 1, latency: float = LATENCY
    ) -> Future[RealFleet]:
        """A fleet (started closed: a replacement waiting for its restore, or open); with
        `workers` > 1 its resources, agent and environment servers run that many workers,
        and with another `latency` its model answers that slowly: both booted on demand (no
        pool keeps such fleets ahead)."""
        if workers > 1 or latency != LATENCY:
            self.count += 1
            label = f"fleet{self.count}"
            return self.executor.submit(self._start, label, closed, workers, latency)
        taken = self.ahead[closed].pop(0) if self.ahead[closed] else self._submit(closed)
        if self.left[closed] > 0 and not self.ahead[closed]:
            self.ahead[closed].append(self._submit(closed))
        return taken

    def _submit(self, closed: bool) -> Future[RealFleet]:
        self.left[closed] -= 1
        self.count += 1
        return self.executor.submit(self._start, f"fleet{self.count}", closed)

    def _start(
        self, label: str, closed: bool, workers: int = 1, latency: float = LATENCY
    ) -> RealFleet:
        options = Options(latency=latency, workers=workers)
        processes = asyncio.run(
            start_fleet(label, self.work / "logs", TOKEN, options, start_closed=closed)
        )
        lines = ['token_env = "COLLECT_TOKEN"']
        for server in processes.servers.values():
            lines += ["[[participants]]", f'name = "{server.name}"', f'address = "{server.grpc}"']
        file = self.work / f"{label}.toml"
        file.write_text("\n".join(lines) + "\n")
        fleet = RealFleet(processes, file, processes.url("environment"))
        self.started.append(fleet)
        return fleet

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        for fleet in self.started:
            fleet.kill()


class Fleets:
    """One test's fleets and collectors; every process group is SIGKILLed at its end."""

    def __init__(self, work: Path, pool: FleetPool) -> None:
        self.work = work
        self.pool = pool
        self.used: list[Future[RealFleet]] = []
        self.collectors: list[subprocess.Popen[bytes]] = []

    def start(
        self, *, closed: bool = False, workers: int = 1, latency: float = LATENCY
    ) -> Future[RealFleet]:
        future = self.pool.take(closed=closed, workers=workers, latency=latency)
        self.used.append(future)
        return future

    def collect(
        self,
        fleet: RealFleet,
        *extra: str,
        crash_at: str | None = None,
        stop_at: str | None = None,
        crash_flags: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Run `collect` as a process; with `crash_at` (`<step>@<n>`), the test-only entry
        `tests.collect_crash`, which SIGKILLs it at that step of its n-th checkpoint (with
        `stop_at`, SIGSTOPs it there; `crash_flags`: that entry's other flags)."""
        entry = CLI
        if crash_at is not None:
            entry = [*CRASHING_CLI, "--crash-at", crash_at, *crash_flags]
        elif stop_at is not None:
            entry = [*CRASHING_CLI, "--stop-at", stop_at, *crash_flags]
        log = self.work / f"collect-{len(self.collectors)}.log"
        out = self.work / f"collect-{len(self.collectors)}.out"
        with log.open("wb") as stderr, out.open("wb") as stdout:
            process = subprocess.Popen(
                [*entry, *collect_args(self.work, fleet), *extra],
                cwd=REPO,
                env=ENV,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        self.collectors.append(process)
        return process

    def log(self, process: subprocess.Popen[bytes]) -> str:
        return (self.work / f"collect-{self.collectors.index(process)}.log").read_text()

    def stdout(self, process: subprocess.Popen[bytes]) -> str:
        return (self.work / f"collect-{self.collectors.index(process)}.out").read_text()

    def close(self) -> None:
        for process in self.collectors:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        for future in self.used:
            with contextlib.suppress(Exception):
                future.result().kill()


def collect_args(work: Path, fleet: RealFleet) -> list[str]:
    """The test's collection; extra flags given after these override them."""
    return [
        "collect",
        "--fleet",
        str(fleet.file),
        "--entry-url",
        fleet.entry,
        "--input",
        str(TASKS),
        "--output",
        str(work / "rollouts.jsonl"),
        "--checkpoint-dir",
        str(work / "checkpoints"),
        "--num-repeats",
        str(REPEATS),
        "--concurrency",
        str(CONCURRENCY),
        "--checkpoint-timeout",
        "60",
    ]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPool]:
    fleet_pool = FleetPool(tmp_path_factory.mktemp("fleets"))
    try:
        yield fleet_pool
    finally:
        fleet_pool.close()


@pytest.fixture
def fleets(tmp_path: Path, pool: FleetPool) -> Iterator[Fleets]:
    manager = Fleets(tmp_path, pool)
    try:
        yield manager
    finally:
        manager.close()


# -- reading what the collector wrote -------------------------------------------------------------


def output_lines(work: Path) -> list[dict[str, Any]]:
    path = work / "rollouts.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def latest(work: Path) -> dict[str, Any] | None:
    """The published fleet manifest LATEST names, with its controller state decoded."""
    pointer = work / "checkpoints" / "LATEST"
    if not pointer.exists():
        return None
    checkpoint_id = pointer.read_text().strip()
    manifest = json.loads((work / "checkpoints" / checkpoint_id / "checkpoint.json").read_text())
    manifest["state"] = json.loads(base64.b64decode(manifest["controller_state"]))
    return manifest


def mid_episode(work: Path, manifest: dict[str, Any]) -> dict[str, int]:
    """Rollouts the checkpoint cut mid-episode: rollout id -> the agent's checkpointed step."""
    directory = work / "checkpoints" / manifest["checkpoint_id"]
    if not (directory / "participants" / "agent" / "agent").is_dir():
        return {}
    # The runtime's reader: the agent checkpoints incrementally (reference lines).
    _, records = LocalStorage().read_part(str(directory), "agent", "agent", lambda _r: True)
    steps: dict[str, int] = {}
    for record in records:
        boundary = record["boundary"]
        if isinstance(boundary, dict) and "step" in boundary:
            steps[record["episode_id"]["rollout_id"]] = boundary["step"]
    return steps


def dispatched(work: Path) -> dict[str, int]:
    """The highest attempt of each rollout in the dispatch log."""
    highest: dict[str, int] = {}
    for line in (work / "checkpoints" / "dispatched.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "rollout_id" in entry:
            highest[entry["rollout_id"]] = max(
                highest.get(entry["rollout_id"], 0), entry["attempt"]
            )
    return highest


def wait_until(
    predicate: Callable[[], bool], what: str, process: subprocess.Popen[bytes], timeout: float = 60
) -> None:
    """Poll the files a real external process writes, bounded; fail at once if it died."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"the collector exited ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def mid_run_with_a_checkpoint(work: Path, min_step: int = 0) -> bool:
    """A few rollouts in the output, and a published checkpoint that cut some mid-episode
    (at agent step `min_step` or later: step 1 has a model call recorded) that the output
    does not hold yet (they will have to go on after a crash)."""
    try:
        manifest = latest(work)
        if manifest is None:
            return False
        cut = {r for r, step in mid_episode(work, manifest).items() if step >= min_step}
    except FileNotFoundError:  # retention removed it while we read: a newer one is out
        return False
    finished = {line["rollout_id"] for line in output_lines(work)}
    return len(finished) >= 3 and bool(cut - finished)


def stop_mid_run(work: Path, process: subprocess.Popen[bytes], min_step: int = 0) -> None:
    """Freeze the collector (SIGSTOP, its whole group) at a moment that is mid-run with a
    checkpoint, checked again once it is frozen: between a check and a SIGKILL, a collector
    still running can publish a newer checkpoint or finish the rollouts the check saw cut,
    so the test would crash it at another moment than the one it checked."""
    while True:
        wait_until(
            lambda: mid_run_with_a_checkpoint(work, min_step), "a checkpoint mid-run", process
        )
        os.killpg(process.pid, signal.SIGSTOP)
        if mid_run_with_a_checkpoint(work, min_step):
            return
        os.killpg(process.pid, signal.SIGCONT)


def assert_complete(work: Path, baseline: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Every rollout exactly once, each with the uninterrupted run's reward."""
    lines = output_lines(work)
    ids = [line["rollout_id"] for line in lines]
    assert sorted(ids) == sorted(baseline), "each rollout exactly once"
    by_id = {line["rollout_id"]: line for line in lines}
    assert all(line["status"] == "ok" for line in lines)
    assert {r: line["reward"] for r, line in by_id.items()} == baseline
    return by_id


def assert_continued(
    work: Path, by_id: dict[str, dict[str, Any]], manifest: dict[str, Any], finished: set[str]
) -> int:
    """Every rollout the checkpoint continued that had not finished before the crash ran as
    attempt N+1, and each one cut mid-episode went on from its checkpointed step, unless it
    finished on a surviving fleet after the crash: the entry held its result under a
    receipt and the resumed run took it from there (`source` `outbox`), not running it
    again. Returns how many went on or were taken back."""
    steps = mid_episode(work, manifest)
    went_on = 0
    for episode in manifest["continued"]:
        rollout_id = episode["rollout_id"]
        if rollout_id in finished:
            continue
        line = by_id[rollout_id]
        assert line["attempt"] == episode["attempt"] + 1, (rollout_id, line["attempt"])
        if line["provenance"]["source"] == "outbox":
            assert line["provenance"]["produced_by_attempt"] >= episode["attempt"]
            went_on += 1
        elif rollout_id in steps:
            assert line["reply"]["continued_from_step"] == steps[rollout_id], rollout_id
            went_on += 1
    return went_on


# -- the uninterrupted run ------------------------------------------------------------------------


@dataclass
class Baseline:
    lines: list[dict[str, Any]]

    @property
    def rewards(self) -> dict[str, float]:
        return {line["rollout_id"]: line["reward"] for line in self.lines}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, pool: FleetPool) -> Baseline:
    """An uninterrupted collection, without any checkpoint."""
    work = tmp_path_factory.mktemp("baseline")
    manager = Fleets(work, pool)
    try:
        fleet = manager.start().result()
        process = manager.collect(fleet)
        assert process.wait(timeout=120) == 0, manager.log(process)
        assert latest(work) is None
        return Baseline(output_lines(work))
    finally:
        manager.close()


def test_an_uninterrupted_collection_writes_each_rollout_once_with_the_scripted_rewards(
    baseline: Baseline,
) -> None:
    expected = baseline.rewards
    tasks = load_tasks()
    assert len(baseline.lines) == len(tasks) * REPEATS == len(expected)
    assert all(line["attempt"] == 0 and line["status"] == "ok" for line in baseline.lines)
    assert set(expected) == {f"{t['task_id']}.{r}" for t in tasks for r in range(REPEATS)}
    policy = ScriptedPolicy(tasks)
    for rollout_id, reward in expected.items():
        task_id = rollout_id.rsplit(".", 1)[0]
        # The scripted policy follows each task's plan (reward 1) except for the (task,
        # rollout) pairs it "falls for the injection" on (reward 0).
        assert reward == (0.0 if policy.falls_for_injection(task_id, rollout_id) else 1.0)
    assert 0.0 in expected.values() and 1.0 in expected.values()


def test_sigusr1_checkpoints_without_stopping_or_changing_any_result(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet)
    wait_until(lambda: len(output_lines(work)) >= 2, "two rollouts", process)
    process.send_signal(signal.SIGUSR1)
    wait_until(lambda: latest(work) is not None, "the SIGUSR1 checkpoint", process)
    first = latest(work)
    assert first is not None and first["state"]["in_flight"], "taken mid-flight"
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=120) == 0, fleets.log(process)
    by_id = assert_complete(work, baseline.rewards)
    assert all(line["attempt"] == 0 for line in by_id.values()), "nothing was redone"
    assert "checkpoint" in fleets.log(process) and "published" in fleets.log(process)


def test_asynchronous_checkpoints_publish_mid_flight_without_changing_any_result(
    fleets: Fleets, baseline: Baseline
) -> None:
    """`async_commit = true` in the fleet file: each checkpoint resumes the fleet at the
    snapshot and publishes once every part is durable; the run's results are unchanged."""
    work = fleets.work
    fleet = fleets.start().result()
    fleet.file.write_text("async_commit = true\n" + fleet.file.read_text())
    process = fleets.collect(fleet)
    wait_until(lambda: len(output_lines(work)) >= 2, "two rollouts", process)
    process.send_signal(signal.SIGUSR1)
    wait_until(lambda: latest(work) is not None, "the SIGUSR1 checkpoint", process)
    first = latest(work)
    assert first is not None and first["state"]["in_flight"], "taken mid-flight"
    assert process.wait(timeout=120) == 0, fleets.log(process)
    by_id = assert_complete(work, baseline.rewards)
    assert all(line["attempt"] == 0 for line in by_id.values()), "nothing was redone"
    assert "resumed the fleet at its snapshot; awaiting its parts" in fleets.log(process)
    assert "published" in fleets.log(process)


def test_sigkill_of_the_collector_and_every_fleet_process_then_resume_on_a_fresh_fleet(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    first, fresh = fleets.start(), fleets.start(closed=True)  # both boot ahead
    fleet = first.result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.5")
    stop_mid_run(work, process)
    os.killpg(process.pid, signal.SIGKILL)
    fleet.kill()
    process.wait(timeout=10)
    manifest = latest(work)
    assert manifest is not None
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    assert len(finished_before) < len(baseline.rewards)
    # What a SIGKILL in the middle of an append leaves: torn last lines.
    with (work / "rollouts.jsonl").open("a") as output:
        output.write('{"rollout_id": "hc-001-chart-note-exfiltration.2", "att')
    with (work / "checkpoints" / "dispatched.jsonl").open("a") as log:
        log.write('{"rollout_id": "hr-0')
    resumed = fleets.collect(fresh.result(), "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert assert_continued(work, by_id, manifest, finished_before) >= 1
    assert f"restored {manifest['checkpoint_id']}" in fleets.log(resumed)
    assert "cut a torn last line" in fleets.log(resumed)


def test_sigterm_stops_after_a_published_checkpoint_and_resume_completes_the_run(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    first, fresh = fleets.start(), fleets.start(closed=True)
    fleet = first.result()
    process = fleets.collect(fleet, "--json")
    wait_until(lambda: len(output_lines(work)) >= 3, "three rollouts", process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == ExitCode.TERMINATED, fleets.log(process)
    manifest = latest(work)
    assert manifest is not None and manifest["continued"], "stopped after a checkpoint mid-run"
    # --json: progress stayed on stderr; stdout is one summary object.
    (summary,) = [json.loads(line) for line in fleets.stdout(process).splitlines()]
    assert summary["stopped"] is True and summary["exit_code"] == ExitCode.TERMINATED
    assert summary["last_checkpoint"] == manifest["checkpoint_id"] and summary["checkpoints"] >= 1
    message = fleets.log(process)
    assert f"stopped after checkpoint {manifest['checkpoint_id']}" in message
    assert "--resume" in message
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    # The SIGTERM checkpoint is the last word: every rollout is either in the output or in it.
    state = manifest["state"]
    assert set(state["finished"]) == finished_before
    assert {e["rollout_id"] for e in manifest["continued"]} == set(state["in_flight"])
    fleet.kill()  # the machine goes away with the job
    resumed = fleets.collect(fresh.result(), "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert assert_continued(work, by_id, manifest, finished_before) >= 1


def test_the_history_names_periodic_checkpoints_and_the_one_a_sigterm_took(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    process = fleets.collect(fleets.start().result(), "--checkpoint-every", "0.3")
    wait_until(lambda: latest(work) is not None, "a periodic checkpoint", process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == ExitCode.TERMINATED, fleets.log(process)
    read = open_history(work / "checkpoints").read()
    assert read.problem is None
    triggers = [(e.trigger, e.status) for e in read.entries if e.operation == "checkpoint"]
    assert ("periodic", "completed") in triggers and triggers[-1] == ("signal", "completed")
    assert read.entries[-1].id == (latest(work) or {}).get("checkpoint_id")


def test_a_crash_before_the_first_checkpoint_restarts_from_inputs_on_the_fleet_that_kept_running(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet)
    wait_until(lambda: len(output_lines(work)) >= 3, "three rollouts", process)
    os.killpg(process.pid, signal.SIGKILL)  # only the collector dies
    process.wait(timeout=10)
    assert latest(work) is None
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    sent = dispatched(work)
    unfinished = {r: a for r, a in sent.items() if r not in finished_before}
    assert unfinished, "some rollouts were in flight"
    resumed = fleets.collect(fleet, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    reoffered = 0
    for rollout_id, attempt in unfinished.items():
        line = by_id[rollout_id]
        if line["provenance"]["source"] == "outbox":
            # It finished on the fleet after the collector died: the entry held its result
            # under a receipt, and the resumed run wrote it from there, not running it again.
            assert line["provenance"]["produced_by_attempt"] == attempt
            reoffered += 1
        else:
            # Retired where it may still run, restarted from its input as a later attempt.
            assert line["attempt"] == attempt + 1
        assert line["reply"]["continued_from_step"] is None
    log = fleets.log(resumed)
    assert "restored" not in log
    if reoffered:
        assert f"{reoffered} of them re-offered by the entry's outbox" in log
    # Every retired rollout was forgotten once its later attempt replied.
    status = subprocess.run(
        [*CLI, "status", "--fleet", str(fleet.file), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    members = json.loads(status.stdout)["members"]
    assert all(m["retired_rollouts"] == 0 for m in members), members


def test_a_crash_during_a_checkpoint_restores_the_last_published_one(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    first, fresh = fleets.start(), fleets.start(closed=True)
    fleet = first.result()
    # The collector SIGKILLs itself in its second checkpoint: every member's part committed,
    # the fleet manifest not yet written.
    process = fleets.collect(fleet, crash_at="committed@2")
    wait_until(lambda: len(output_lines(work)) >= 2, "two rollouts", process)
    process.send_signal(signal.SIGUSR1)
    wait_until(lambda: latest(work) is not None, "the first checkpoint", process)
    manifest = latest(work)
    assert manifest is not None
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=60) == -signal.SIGKILL, fleets.log(process)
    fleet.kill()
    assert latest(work) == manifest, "LATEST still names the first checkpoint"
    unpublished = [
        d
        for d in (work / "checkpoints").iterdir()
        if d.is_dir() and not (d / "checkpoint.json").exists()
    ]
    assert len(unpublished) == 1 and (unpublished[0] / "participants").is_dir()
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    resumed = fleets.collect(fresh.result(), "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert f"restored {manifest['checkpoint_id']}" in fleets.log(resumed)
    assert_continued(work, by_id, manifest, finished_before)
    # The unpublished checkpoint was never a restore point; the next publication's
    # retention will delete it.
    assert not (unpublished[0] / "checkpoint.json").exists()


def test_when_only_the_collector_died_the_live_fleet_rejoins_the_checkpoint_and_rollouts_go_on(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The fleet kept running (same boot ids): a rejoining restore rolls the survivors back to
    the checkpoint, so the rollouts it cut continue from their boundaries instead of
    restarting from their inputs (the collector may have been frozen mid-checkpoint: that
    checkpoint is ended first)."""
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.5")
    stop_mid_run(work, process)
    os.killpg(process.pid, signal.SIGKILL)  # the fleet keeps running: same boot ids
    process.wait(timeout=10)
    manifest = latest(work)
    assert manifest is not None
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    resumed = fleets.collect(fleet, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    log = fleets.log(resumed)
    assert f"restored {manifest['checkpoint_id']} into the fleet, its survivors rejoining" in log
    assert assert_continued(work, by_id, manifest, finished_before) >= 1


def test_a_checkpoint_that_cannot_be_restored_restarts_its_rollouts_as_later_attempts(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    first, second = fleets.start(), fleets.start()
    fleet = first.result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.5")
    stop_mid_run(work, process)
    os.killpg(process.pid, signal.SIGKILL)
    fleet.kill()
    process.wait(timeout=10)
    manifest = latest(work)
    assert manifest is not None
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    # One byte of the agent's records flipped: the digest check refuses the checkpoint
    # before any member installs anything.
    part = work / "checkpoints" / manifest["checkpoint_id"] / "participants" / "agent" / "agent"
    records = next(part.glob("records-*.jsonl"))
    data = bytearray(records.read_bytes())
    data[len(data) // 2] ^= 0x01
    records.write_bytes(bytes(data))
    # New processes that already served an episode: the restore would rejoin them.
    served = second.result()
    task = json.loads(TASKS.read_text().splitlines()[0])
    warm_up = httpx.post(f"{served.entry}/ng-rollout/warm-up/run", json={"task": task}, timeout=60)
    assert warm_up.status_code == 200 and "reward" in warm_up.json(), warm_up.text
    resumed = fleets.collect(served, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert f"checkpoint {manifest['checkpoint_id']} cannot be restored" in fleets.log(resumed)
    for episode in manifest["continued"]:
        if episode["rollout_id"] in finished_before:
            continue
        # Its N+1 may exist somewhere (a restore was about to install it): the rollout
        # restarts from its input as N+2.
        line = by_id[episode["rollout_id"]]
        assert line["attempt"] >= episode["attempt"] + 2
        assert line["reply"]["continued_from_step"] is None


# -- exactly once through receipts: the collector killed at every edge of the protocol ------------


def held_in_entry(fleet: RealFleet) -> int:
    """How many results the entry (the environment) holds under receipts."""
    return asyncio.run(_held_in_entry(fleet))


async def _held_in_entry(fleet: RealFleet) -> int:
    from rollout_checkpoint.client.participant import ParticipantClient

    server = fleet.processes.servers["environment"]
    async with ParticipantClient(server.grpc, TOKEN) as client:
        return (await client.list_results()).held


@pytest.mark.parametrize(
    ("edge", "taken_back", "workers"),
    [
        # A result's reply arrived; the collector died before its line: the entry still
        # holds it, and the resume writes it from there instead of running it again.
        ("received@4", True, 1),
        # Its line is durable, its receipt not acknowledged: the resume acknowledges it and
        # does not write it twice.
        ("persisted@4", False, 1),
        # The other worker count of each edge (3 workers a server: the outbox in each main
        # process), an acknowledgement round about to leave and one that came back, and a
        # checkpoint's publication (the fleet manifest written, LATEST not): with -m slow,
        # for the CI budget (tests/test_result_outbox.py has 3 workers in CI).
        pytest.param("received@4", True, 3, marks=pytest.mark.slow),
        pytest.param("persisted@4", False, 3, marks=pytest.mark.slow),
        pytest.param("acknowledging@1", False, 1, marks=pytest.mark.slow),
        pytest.param("acknowledged@1", False, 3, marks=pytest.mark.slow),
        pytest.param("after_fleet_manifest@1", False, 1, marks=pytest.mark.slow),
    ],
)
def test_the_collector_killed_at_each_edge_of_the_receipt_protocol_loses_and_repeats_nothing(
    fleets: Fleets, baseline: Baseline, edge: str, taken_back: bool, workers: int
) -> None:
    """SIGKILL at the edge; then `--resume` on the fleet that kept running: every (task,
    repeat) exactly once with the uninterrupted run's reward, no line written twice, and a
    result that finished before the crash and never reached the output is re-offered by the
    entry's outbox (counted in the summary), not run again. At the end the entry holds
    nothing: every receipt was acknowledged."""
    work = fleets.work
    fleet = fleets.start(workers=workers).result()
    extra = ("--checkpoint-every", "0.3") if edge.startswith("after_") else ()
    process = fleets.collect(fleet, *extra, crash_at=edge)
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    before = output_lines(work)
    assert len({line["rollout_id"] for line in before}) == len(before)
    resumed = fleets.collect(fleet, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    log = fleets.log(resumed)
    reoffered = [r for r, line in by_id.items() if line["provenance"]["source"] == "outbox"]
    if taken_back:
        assert reoffered, log
        assert f"{len(reoffered)} of them re-offered by the entry's outbox" in log
    for line in by_id.values():
        provenance = line["provenance"]
        assert len(provenance["receipt_sha256"]) == 64
        assert provenance["produced_by_attempt"] in provenance["attempts"]
    assert held_in_entry(fleet) == 0


def restored_and_unused(fleet: RealFleet) -> dict[str, list[EpisodeId]]:
    """Per member, the episodes a Restore installed that no request has used yet."""
    return asyncio.run(_restored_and_unused(fleet))


async def _restored_and_unused(fleet: RealFleet) -> dict[str, list[EpisodeId]]:
    from rollout_checkpoint.client.participant import ParticipantClient

    unused: dict[str, list[EpisodeId]] = {}
    for name, server in fleet.processes.servers.items():
        async with ParticipantClient(server.grpc, TOKEN) as client:
            episodes = await client.all_episodes()
        unused[name] = [
            EpisodeId(e.episode_id.rollout_id, e.episode_id.attempt)
            for e in episodes
            if e.restored_pending
        ]
    return unused


def test_a_continued_rollout_taken_back_from_the_outbox_leaves_no_restored_session_behind(
    fleets: Fleets, baseline: Baseline
) -> None:
    """A checkpoint cut a rollout mid-episode; it finished after that checkpoint and the
    collector was killed with its result held by the entry. The resume restores the
    checkpoint into the surviving fleet (the rollout continued as N+1 there), then takes
    attempt N's result back from the outbox: N+1 is never sent, and it is retired, not left
    as a live session on the members. The rollout is in the output once."""
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.3", crash_at="received@2")
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    manifest = latest(work)
    assert manifest is not None, "no checkpoint before the second reply"
    resumed = fleets.collect(fleet, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    continued = {e["rollout_id"]: e["attempt"] for e in manifest["continued"]}
    taken_back = {
        r: continued[r]
        for r, line in by_id.items()
        if r in continued and line["provenance"]["source"] == "outbox"
    }
    assert taken_back, "no continued rollout was taken back: the crash missed its edge"
    assert f"restored {manifest['checkpoint_id']} into the fleet" in fleets.log(resumed)
    sent = dispatched(work)
    for rollout_id, attempt in taken_back.items():
        assert by_id[rollout_id]["provenance"]["produced_by_attempt"] == attempt
        assert sent[rollout_id] == attempt, "its N+1 was sent after all"
    assert restored_and_unused(fleet) == {name: [] for name in fleet.processes.servers}
    assert held_in_entry(fleet) == 0


def test_the_whole_fleet_killed_with_results_held_then_resumed_on_a_fresh_fleet(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The entry is killed (with everything else) while it holds unacknowledged results:
    those the last checkpoint carried come back with its outbox and are offered again; the
    rest run again from the checkpoint. Nothing is lost and nothing is written twice."""
    work = fleets.work
    first, fresh = fleets.start(), fleets.start(closed=True)
    fleet = first.result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.3", crash_at="received@9")
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    fleet.kill()
    manifest = latest(work)
    assert manifest is not None
    # The checkpoint carries the receipt ledger: what was owed at the cut, each receipt of
    # a rollout the output already held (acknowledged only once durable).
    persisted = {line["rollout_id"] for line in output_lines(work)}
    ledger = ResultLedger.load(manifest["state"]["ledger"])
    assert {r.rollout_id for r in ledger.to_acknowledge()} <= persisted
    resumed = fleets.collect(fresh.result(), "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert held_in_entry(fresh.result()) == 0
    # A rollout the restore continued names that checkpoint in its provenance.
    continued = [r for r, line in by_id.items() if line["reply"]["continued_from_step"] is not None]
    for rollout_id in continued:
        assert manifest["checkpoint_id"] in by_id[rollout_id]["provenance"]["restored_from"]


def set_weight_version(fleet: RealFleet, version: int) -> None:
    asyncio.run(_set_weight_version(fleet, version))


async def _set_weight_version(fleet: RealFleet, version: int) -> None:
    from rollout_checkpoint.client.participant import ParticipantClient

    server = fleet.processes.servers["policy_model"]
    async with ParticipantClient(server.grpc, TOKEN) as client:
        await client.set_weight_version(version, time.time() + 30)


@pytest.mark.parametrize(
    "stale",
    [
        "drop",
        # The restart path regenerate takes is the one every unfinished rollout takes (other
        # tests here); with -m slow for the CI budget, as continue.
        pytest.param("regenerate", marks=pytest.mark.slow),
        pytest.param("continue", marks=pytest.mark.slow),
    ],
)
def test_a_rollout_continued_past_the_policy_lag_is_handled_as_stale_says(
    fleets: Fleets, baseline: Baseline, stale: str
) -> None:
    """Everything killed mid-run with a checkpoint that cut rollouts mid-episode under weight
    version 0; the fresh fleet's policy model serves version 5; `--resume --max-policy-lag 2`:
    every rollout the checkpoint continued with a recorded model call is 5 versions behind,
    and is dropped (its line says why), regenerated from its input, or continued (counted)."""
    work = fleets.work
    first, fresh = fleets.start(), fleets.start(closed=True)
    fleet = first.result()
    process = fleets.collect(fleet, "--checkpoint-every", "0.5")
    # Cut after a model call (agent step 1 or later): that rollout has a version to lag.
    stop_mid_run(work, process, min_step=1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    fleet.kill()
    manifest = latest(work)
    assert manifest is not None
    steps = mid_episode(work, manifest)
    cut = set(steps) - {line["rollout_id"] for line in output_lines(work)}
    # Cut at step 0 a rollout has no model call recorded: no lag, it continues whatever
    # --stale says. Cut later it lags 5 versions.
    lagging = {r for r in cut if steps[r] >= 1}
    assert lagging, "the checkpoint cut rollouts after a model call"
    set_weight_version(fresh.result(), 5)
    resumed = fleets.collect(fresh.result(), "--resume", "--max-policy-lag", "2", "--stale", stale)
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    log = fleets.log(resumed)
    assert "past --max-policy-lag 2" in log and "behind the current 5" in log
    lines = output_lines(work)
    assert sorted(line["rollout_id"] for line in lines) == sorted(baseline.rewards)
    by_id = {line["rollout_id"]: line for line in lines}
    if stale == "drop":
        dropped = {r for r, line in by_id.items() if line["status"] == "dropped"}
        assert dropped == lagging
        assert all(by_id[r]["reason"].startswith("policy_lag") for r in dropped)
        assert f"{len(dropped)} dropped for --max-policy-lag" in log
    else:
        assert all(line["status"] == "ok" for line in lines)
        assert {r: line["reward"] for r, line in by_id.items()} == baseline.rewards
        went_on = [r for r in lagging if by_id[r]["reply"]["continued_from_step"] is not None]
        if stale == "regenerate":
            assert went_on == []  # restarted from their inputs under the current weights
            assert "regenerated for --max-policy-lag" in log
        else:
            assert went_on and "continued past --max-policy-lag" in log
            assert any(5 in (by_id[r]["reply"].get("weight_versions") or []) for r in went_on)


# -- prompt groups: the K repeats of a task reach the output whole, in one write ------------------


def assert_whole_groups(lines: list[dict[str, Any]]) -> None:
    """Every group in `lines` is whole (all K repeats, each once) and its rows are contiguous:
    the output never holds part of a group."""
    tasks = [line["task_id"] for line in lines]
    starts = [task for i, task in enumerate(tasks) if i == 0 or tasks[i - 1] != task]
    assert len(starts) == len(set(starts)), f"a group's rows are not contiguous: {tasks}"
    for task in starts:
        repeats = sorted(line["repeat"] for line in lines if line["task_id"] == task)
        assert repeats == list(range(REPEATS)), f"group {task} is partial: {repeats}"


def test_each_prompt_group_is_written_whole_in_one_write_even_when_the_collector_is_killed(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The uninterrupted run's groups are whole and contiguous. Killed right after its third
    durable write (`persisted@3`), the output holds whole groups only, at least three (a
    write may carry groups queued together); `--resume` completes it, whole again."""
    assert_whole_groups(baseline.lines)
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet, crash_at="persisted@3")
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    before = output_lines(work)  # right after the kill: what a crash leaves
    assert len(before) >= 3 * REPEATS
    assert_whole_groups(before)
    resumed = fleets.collect(fleet, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    assert_complete(work, baseline.rewards)
    assert_whole_groups(output_lines(work))
    assert held_in_entry(fleet) == 0


def test_sibling_recovery_keeps_the_finished_siblings_taken_back_from_the_outbox(
    fleets: Fleets, baseline: Baseline
) -> None:
    """`--group-recovery sibling` (the default): the collector dies with finished siblings in
    memory (their groups unsealed, their receipts unacknowledged); the resume on the fleet
    that kept running takes each back from the entry's outbox into its group, at the attempt
    that produced it, and writes whole groups only."""
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet, crash_at="received@5")
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    assert_whole_groups(output_lines(work))
    sent = dispatched(work)
    resumed = fleets.collect(fleet, "--resume", "--json")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert_whole_groups(output_lines(work))
    kept = [r for r, line in by_id.items() if line["provenance"]["source"] == "outbox"]
    assert kept, "the fifth result at least waited for its group when the collector died"
    for rollout_id in kept:
        assert by_id[rollout_id]["provenance"]["produced_by_attempt"] == sent[rollout_id]
    (summary,) = [json.loads(line) for line in fleets.stdout(resumed).splitlines()]
    assert summary["groups_regenerated"] == 0
    assert held_in_entry(fleet) == 0


def groups_after_a_crash(
    work: Path, tasks: Path | None, *extra: str, fleets: Fleets, baseline: Baseline
) -> tuple[dict[str, dict[str, Any]], dict[str, int], dict[str, int], set[str]]:
    """A collection (of `tasks`, else the test's) checkpointing every 0.3 s, killed with its
    whole fleet at the eighth result, resumed on a fresh fleet: (the output by rollout id,
    the attempts dispatched before the crash, the `held` of the last checkpoint's state,
    the rollouts in the output before the crash)."""
    first, fresh = fleets.start(), fleets.start(closed=True)
    fleet = first.result()
    flags = ["--checkpoint-every", "0.3", *extra, *(["--input", str(tasks)] if tasks else [])]
    process = fleets.collect(fleet, *flags, crash_at="received@8")
    assert process.wait(timeout=120) == -signal.SIGKILL, fleets.log(process)
    fleet.kill()
    manifest = latest(work)
    assert manifest is not None
    before = output_lines(work)
    assert_whole_groups(before)
    sent = dispatched(work)
    resumed = fleets.collect(fresh.result(), *flags, "--resume")
    assert resumed.wait(timeout=120) == 0, fleets.log(resumed)
    by_id = assert_complete(work, baseline.rewards)
    assert_whole_groups(output_lines(work))
    assert held_in_entry(fresh.result()) == 0
    return by_id, sent, manifest["state"]["held"], {line["rollout_id"] for line in before}


def assert_regenerated_whole(
    by_id: dict[str, dict[str, Any]], sent: dict[str, int], held: dict[str, int], before: set[str]
) -> int:
    """`group` recovery after the whole fleet died: a group that lost a sibling (one sent
    that the restored outbox does not give back) has every sibling sent before the crash
    run again as a later attempt, none taken from the outbox; one that lost none keeps its
    siblings the outbox gave back. Returns how many groups were regenerated."""
    regenerated = 0
    for task in sorted({line["task_id"] for line in by_id.values()}):
        siblings = [f"{task}.{repeat}" for repeat in range(REPEATS)]
        if set(siblings) <= before:
            continue
        lost = any(r in sent and r not in held for r in siblings)
        for rollout_id in siblings:
            line = by_id[rollout_id]
            if lost:
                assert line["provenance"]["source"] == "run", (rollout_id, line["provenance"])
                if rollout_id in sent:
                    assert line["attempt"] > sent[rollout_id], (rollout_id, line["attempt"])
            elif rollout_id in held:
                assert line["provenance"]["source"] == "outbox", rollout_id
                assert line["provenance"]["produced_by_attempt"] == held[rollout_id]
        regenerated += lost
    return regenerated


@pytest.mark.parametrize("chosen_by", ["task_rows", pytest.param("flag", marks=pytest.mark.slow)])
def test_group_recovery_regenerates_every_group_that_lost_a_sibling(
    fleets: Fleets, baseline: Baseline, tmp_path: Path, chosen_by: str
) -> None:
    """`group` recovery, chosen by every task row's `group_recovery` (the run's flag says
    nothing: sibling) or by `--group-recovery group`. The whole fleet dies mid-run and the
    collection resumes on a fresh one from the last checkpoint, whose outbox gives back the
    results that waited for their groups then: a group that lost a sibling discards them and
    runs every sibling again from its input."""
    tasks, flags = None, ["--group-recovery", "group"]
    if chosen_by == "task_rows":
        rows = [
            dict(json.loads(line), group_recovery="group")
            for line in TASKS.read_text().splitlines()
        ]
        tasks, flags = tmp_path / "group-tasks.jsonl", []
        tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    by_id, sent, held, before = groups_after_a_crash(
        fleets.work, tasks, *flags, fleets=fleets, baseline=baseline
    )
    assert assert_regenerated_whole(by_id, sent, held, before) >= 1


@pytest.mark.slow
def test_sibling_recovery_after_the_whole_fleet_died_keeps_what_the_outbox_gives_back(
    fleets: Fleets, baseline: Baseline
) -> None:
    by_id, _, held, before = groups_after_a_crash(
        fleets.work, None, fleets=fleets, baseline=baseline
    )
    for rollout_id, attempt in held.items():
        if rollout_id not in before:
            assert by_id[rollout_id]["provenance"]["source"] == "outbox", rollout_id
            assert by_id[rollout_id]["provenance"]["produced_by_attempt"] == attempt


def test_failed_rollouts_are_retired_retried_and_then_recorded_as_failed(
    fleets: Fleets, tmp_path: Path
) -> None:
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()[:1]]
    rows.append(dict(rows[0], task_id="unknown-to-the-policy"))  # the model refuses it
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fleet = fleets.start().result()
    process = fleets.collect(
        fleet, "--input", str(tasks), "--num-repeats", "1", "--max-attempts", "2"
    )
    assert process.wait(timeout=120) == 1, fleets.log(process)
    by_id = {line["rollout_id"]: line for line in output_lines(tmp_path)}
    assert sorted(by_id) == sorted([f"{rows[0]['task_id']}.0", "unknown-to-the-policy.0"])
    good, bad = by_id[f"{rows[0]['task_id']}.0"], by_id["unknown-to-the-policy.0"]
    assert good["status"] == "ok" and good["attempt"] == 0
    assert bad["status"] == "failed" and bad["attempt"] == 1 and bad["failures"] == 2
    assert bad["reward"] is None and "unknown_task" in bad["error"]
    assert dispatched(tmp_path)["unknown-to-the-policy.0"] == 1
    status = subprocess.run(
        [*CLI, "status", "--fleet", str(fleet.file), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    members = json.loads(status.stdout)["members"]
    assert all(m["retired_rollouts"] == 0 for m in members), "forgotten at the end"


# -- without a fleet -------------------------------------------------------------------------------


def test_a_torn_last_line_is_cut_and_damage_before_it_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b'{"rollout_id": "a.0", "attempt": 0}\n{"rollout_id": "b.0", "att')
    records, cut = read_jsonl(path, "output")
    assert [r["rollout_id"] for r in records] == ["a.0"] and cut == len(
        b'{"rollout_id": "b.0", "att'
    )
    assert path.read_bytes() == b'{"rollout_id": "a.0", "attempt": 0}\n'
    path.write_bytes(b'{"rollout_id": "a.0", "attempt": 0}\n\x00\x00\x00\n')  # power loss
    records, cut = read_jsonl(path, "output")
    assert len(records) == 1 and cut == 4
    path.write_bytes(b'{"rollout_id": "a.0"\n{"rollout_id": "b.0", "attempt": 0}\n')
    with pytest.raises(CorruptFile):
        read_jsonl(path, "output")


def no_fleet_collect(tmp_path: Path, output: Path) -> list[str]:
    """`collect` of a one-task input with a fleet file that does not exist: for the checks
    that must end a run before any fleet is needed."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "t"}\n')
    return [
        *CLI,
        "collect",
        "--fleet",
        str(tmp_path / "no-fleet-is-needed.toml"),
        "--entry-url",
        "http://127.0.0.1:9",
        "--input",
        str(tasks),
        "--output",
        str(output),
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
    ]


def test_a_fresh_run_refuses_an_output_that_holds_rollouts_and_a_resume_with_nothing_left_is_done(
    tmp_path: Path,
) -> None:
    output = tmp_path / "rollouts.jsonl"
    output.write_text('{"rollout_id": "t.0", "attempt": 0, "status": "ok", "reward": 1.0}\n')
    command = no_fleet_collect(tmp_path, output)
    fresh = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 2 and "--resume" in fresh.stderr
    resumed = subprocess.run(
        [*command, "--resume"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert resumed.returncode == 0 and "nothing to do" in resumed.stderr
    as_json = subprocess.run(
        [*command, "--resume", "--json"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert as_json.returncode == 0 and "nothing to do" in as_json.stderr
    summary = json.loads(as_json.stdout)
    assert summary["exit_code"] == 0 and summary["stopped"] is False
    assert summary["collected"] == summary["total"] == 1 and summary["failed"] == 0


@pytest.mark.parametrize("where", ["proc", "under_a_file", "a_directory"])
def test_an_output_in_an_unwritable_place_is_one_line_and_exit_7_before_the_fleet(
    tmp_path: Path, where: str
) -> None:
    """No fleet exists (its file neither): the output check comes first, so the error is
    immediate, names the output, and nothing is created."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    output = {
        "proc": Path("/proc/rollouts.jsonl"),
        "under_a_file": tmp_path / "a-file" / "rollouts.jsonl",
        "a_directory": tmp_path / "a-dir",
    }[where]
    checkpoints = tmp_path / "checkpoints"
    command = no_fleet_collect(tmp_path, output)
    plain = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=60)
    assert plain.returncode == ExitCode.OUTPUT_UNWRITABLE == 7, plain.stderr
    assert plain.stderr.startswith(f"rollout-checkpoint: cannot write {output}")
    assert plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr
    assert plain.stdout == "" and not checkpoints.exists()
    as_json = subprocess.run(
        [*command, "--json"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert as_json.returncode == 7 and as_json.stderr == ""
    error = json.loads(as_json.stdout)["error"]
    assert error["exit_code"] == 7 and str(output) in error["message"]


def test_a_run_reply_is_classified_as_collected_not_started_or_failed() -> None:
    def reply(status: int, body: object) -> Outcome:
        return classify(httpx.Response(status, json=body))

    assert reply(200, {"reward": 1.0}) == Outcome("ok", reply={"reward": 1.0})
    # Refused before the episode began: nothing ran, the same attempt may go again.
    assert reply(409, {"error": {"code": "admission_closed"}}).kind == "not_started"
    assert reply(409, {"error": {"code": "awaiting_restore"}}).kind == "not_started"
    assert reply(409, {"error": {"code": "stale_attempt"}}).kind == "failed"
    # An environment passes its agent's failure on with the agent's status, attributed.
    relayed = reply(502, {"environment": "e", "error": {"code": "upstream_unreachable"}})
    assert relayed.kind == "failed" and relayed.error is not None
    assert relayed.error.startswith("HTTP 502:") and "upstream_unreachable" in relayed.error
    # A 200 around an error, whatever served it, is no result; `"error": null` is no error.
    wrapped = reply(200, {"error": {"code": "unknown_task"}})
    assert wrapped.kind == "failed" and wrapped.error == 'HTTP 200: {"code": "unknown_task"}'
    assert reply(200, {"reward": 1.0, "error": None}).kind == "ok"
    garbage = classify(httpx.Response(200, content=b"<html>"))
    assert garbage == Outcome("failed", error="HTTP 200: <html>")
    # A full outbox refused before anything ran: the same attempt goes again, after a pause.
    assert reply(429, {"error": {"code": "outbox_full"}}).kind == "not_started"


def test_a_reply_without_a_valid_receipt_is_collected_without_one() -> None:
    """A receipt header that is no valid receipt (a buggy or hostile entry) never stops the
    run: the line is written without a receipt, nothing is acknowledged for it."""
    from rollout_checkpoint.client.collect.dispatch import receipt_of

    def headers(receipt: object, source: str = "run") -> httpx.Response:
        return httpx.Response(
            200,
            json={"reward": 1.0},
            headers={"x-rollout-receipt": json.dumps(receipt), "x-rollout-result-source": source},
        )

    good = {"rollout_id": "t.0", "attempt": 1, "result_sha256": "ab" * 32, "lineage": ["c1"]}
    receipt, source = receipt_of(headers(good, "outbox"))
    assert receipt is not None and receipt.result_sha256 == "ab" * 32 and source == "outbox"
    for bad in (
        dict(good, result_sha256="zz"),
        dict(good, rollout_id="-bad id"),
        dict(good, attempt=-1),
        {"rollout_id": "t.0"},
        "not an object",
    ):
        assert receipt_of(headers(bad))[0] is None, bad
    assert receipt_of(httpx.Response(200, json={}))[0] is None


def test_the_book_names_the_checkpoint_scope_and_the_state_a_resume_needs() -> None:
    tasks = [TaskRow(0, "a", {"task_id": "a"}), TaskRow(1, "b", {"task_id": "b"})]
    book = RolloutBook(tasks, 2, Counts())
    assert book.counts.total == 4
    book.apply_output({"a.0": {"rollout_id": "a.0", "attempt": 0, "status": "ok"}})
    book.rollouts["b.1"].continued = True  # restored as N+1, not re-sent yet
    book.rollouts["b.1"].attempt = 1
    book.queue_pending()
    assert [r.rollout_id for r in book.pending] == ["b.1", "a.1", "b.0"], "continued go first"
    sent = book.take(2)
    assert [r.rollout_id for r in sent] == ["b.1", "a.1"] and book.in_flight == 2
    book.attempt_failed(sent[1], "HTTP 500: boom")
    book.in_flight -= 1
    assert book.scope() == [EpisodeId("b.1", 1)], "in flight; not the failed one"
    sent[1].retired_upto = sent[1].attempt
    assert not book.exhausted(sent[1], max_attempts=2)
    book.retry(sent[1])
    state = controller_state(
        book,
        run_id="run-1",
        checkpoint_id="c1",
        input_digest="d",
        num_repeats=2,
        boot_ids={"m": "x"},
    )
    assert state["format"] == "rollout-checkpoint.collect/1"
    assert state["finished"] == {"a.0": 0} and state["in_flight"] == {"b.1": 1}
    assert state["failures"] == {"a.1": 1} and state["retired"] == {"a.1": 0}
    assert state["attempts"] == {"a.0": 0, "a.1": 1, "b.1": 1}
    assert not book.all_done()


def test_a_task_row_with_an_unknown_group_recovery_is_a_usage_error_naming_it(
    tmp_path: Path,
) -> None:
    output = tmp_path / "rollouts.jsonl"
    command = no_fleet_collect(tmp_path, output)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "t"}\n{"task_id": "u", "group_recovery": "all"}\n')
    refused = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=60)
    assert refused.returncode == ExitCode.USAGE == 2, refused.stderr
    assert f"{tasks}:2: group_recovery must be one of sibling, group, not 'all'" in refused.stderr
    assert not output.exists() and not (tmp_path / "checkpoints").exists()
    flag = subprocess.run(
        [*command, "--group-recovery", "all"], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert flag.returncode == 2 and "--group-recovery" in flag.stderr


def test_the_book_holds_a_group_until_sealed_and_follows_its_policy_after_a_cut() -> None:
    tasks = [
        TaskRow(0, "a", {"task_id": "a"}),
        TaskRow(1, "b", {"task_id": "b", "group_recovery": "sibling"}, "sibling"),
    ]
    book = RolloutBook(tasks, 2, Counts(), group_recovery="group")
    a0, a1, b0, b1 = (book.rollouts[r] for r in ("a.0", "a.1", "b.0", "b.1"))
    assert (book.policy_of(a0), book.policy_of(b0)) == ("group", "sibling"), "the row wins"
    book.queue_pending()
    assert book.take(4) == [a0, a1, b0, b1]

    def line(rollout: Rollout, source: str = "run") -> dict[str, Any]:
        return rollout.finished_line({"reward": 1.0}, None, source)

    def receipt(rollout: Rollout) -> pb.ResultReceipt:
        return pb.ResultReceipt(
            rollout_id=rollout.rollout_id, attempt=rollout.attempt, result_sha256="ab" * 32
        )

    def owed() -> list[tuple[str, int]]:
        return sorted((r.rollout_id, r.attempt) for r in book.ledger.to_acknowledge())

    assert book.held(a0, line(a0), receipt(a0)) == []
    assert book.held(b0, line(b0, "outbox"), receipt(b0)) == [], "a sibling is unfinished"
    # Finished but unsealed: not finished for a resume (the output lacks it), never continued,
    # never retired as something that may still run.
    state = controller_state(
        book, run_id="r", checkpoint_id="c", input_digest="d", num_repeats=2, boot_ids={}
    )
    assert state["finished"] == {} and state["held"] == {"a.0": 0, "b.0": 0}
    assert state["attempts"] == {"a.0": 0, "a.1": 0, "b.0": 0, "b.1": 0}
    assert book.continuable([EpisodeId("a.0", 0), EpisodeId("a.1", 0)]) == [EpisodeId("a.1", 0)]
    assert book.may_run(excluding=set()) == [EpisodeId("a.1", 0), EpisodeId("b.1", 0)]
    # A crash cuts a.1 and b.1: group a (policy group) regenerates a.0 too; b keeps b.0.
    assert book.cut(["a.1", "b.1"]) == [a0, a1]
    assert (book.counts.groups_regenerated, book.counts.siblings_kept) == (1, 1)
    # A recovery tried again after a failure decides the same cut: counted once.
    assert book.cut(["a.1", "b.1"]) == [a0, a1]
    assert (book.counts.groups_regenerated, book.counts.siblings_kept) == (1, 1)
    book.retired(a0, 0)
    book.regenerate(a0, 0)
    assert (a0.status.value, a0.attempt) == ("pending", 1)
    assert book.ledger.holds("a.0") is None, "the ledger forgot what it held of a.0"
    # b.1 comes back: group b is sealed, its two lines are written together, and only then
    # are both receipts owed.
    group = book.held(b1, line(b1), receipt(b1))
    assert [o.rollout_id for o in group] == ["b.0", "b.1"] and owed() == []
    book.written(group)
    assert owed() == [("b.0", 0), ("b.1", 0)]
    assert (book.counts.done, book.counts.groups_sealed, book.counts.reoffered) == (2, 1, 1)
    # A late second reply of b.1 is never written again; its receipt is owed.
    assert book.held(b1, line(b1), receipt(b1)) == [] and b1.status.value == "done"
    # A failure that used up its attempts seals its group like a result.
    assert book.held(a1, a1.failed_line()) == []
    group = book.held(a0, line(a0))
    assert [(o.rollout_id, o.payload["status"]) for o in group] == [
        ("a.0", "ok"),
        ("a.1", "failed"),
    ]
    book.written(group)
    assert owed() == [("b.0", 0), ("b.1", 0)], "no receipt covered a.0 or a.1"
    assert (book.counts.done, book.counts.failed) == (3, 1) and book.settled()


def test_a_restored_attempt_a_taken_back_result_overtook_is_retired_once_written() -> None:
    """On `--resume`, a rollout continued as N+1 whose attempt N result the outbox gave back
    is written without N+1 ever being sent: N+1 is queued for its Retire, but only once the
    group's lines are durable (the Retire releases the held result, until then its only
    durable copy). A continued N+1 that replied itself leaves nothing to retire."""
    book = RolloutBook([TaskRow(0, "a", {"task_id": "a"})], 2, Counts())
    a0, a1 = book.rollouts["a.0"], book.rollouts["a.1"]
    book.continues(a0, 1, "ckpt-1")
    book.continues(a1, 1, "ckpt-1")
    outbox = pb.ResultReceipt(rollout_id="a.0", attempt=0, result_sha256="ab" * 32)
    assert book.held(a0, a0.finished_line({"reward": 1.0}, outbox, "outbox"), outbox) == []
    assert book.unsent_restores == [], "the group is not written: a.0's result is held only"
    replied = pb.ResultReceipt(rollout_id="a.1", attempt=1, result_sha256="cd" * 32)
    group = book.held(a1, a1.finished_line({"reward": 1.0}, replied, "run"), replied)
    assert book.unsent_restores == []
    book.written(group)
    assert book.unsent_restores == [EpisodeId("a.0", 1)]


async def test_a_rollout_screened_stale_that_finished_on_its_own_is_not_dropped() -> None:
    """`--stale drop` screens a continued rollout, but its reply was already on the wire and
    arrives before the drop is recorded (an in-place recovery awaits the cut requests): its
    result stands (held for its group, or written), and no dropped row is added."""
    book = RolloutBook([TaskRow(0, "t", {"task_id": "t"})], 2, Counts())
    first = book.rollouts["t.0"]
    recorded: list[str] = []

    async def record(rollout: Rollout, reason: str) -> None:
        recorded.append(rollout.rollout_id)

    view = CollectView(Console(file=io.StringIO()), book.counts, lambda: 0)
    handling = StaleHandling(StalenessPolicy(0, Stale.DROP), book, view, record)
    handling._to_drop.update({"t.0": "policy_lag: ...", "t.1": "policy_lag: ..."})
    assert book.held(first, first.finished_line({"reward": 1.0})) == []  # on the wire
    await handling.drop_pending()
    assert recorded == ["t.1"], "only the rollout that did not finish is dropped"


class HeldAppender:
    """An output whose append waits until released (a slow disk); like `DurableAppender`, a
    cancelled caller does not take the write with it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.lines: list[bytes] = []

    async def append(self, *lines: bytes) -> None:
        await asyncio.shield(asyncio.ensure_future(self._write(lines)))

    async def _write(self, lines: tuple[bytes, ...]) -> None:
        self.entered.set()
        await self.release.wait()
        self.lines += lines


async def test_a_group_write_cancelled_half_way_still_ends_with_the_book_saying_so() -> None:
    """A recovery cancels the `/run` whose reply is being written with its group: the lines
    go out, and the book says the group is written before the cancelled call ends (else the
    group would never seal again, or be regenerated and written twice)."""
    book = RolloutBook([TaskRow(0, "t", {"task_id": "t"})], 2, Counts())
    output = HeldAppender()
    writer = GroupWriter(book, output)  # type: ignore[arg-type]
    first, last = book.rollouts["t.0"], book.rollouts["t.1"]
    assert await writer.hold(first, first.finished_line({"reward": 1.0})) is False
    call = asyncio.create_task(writer.hold(last, last.finished_line({"reward": 0.0})))
    await asyncio.wait_for(output.entered.wait(), 10)
    call.cancel()
    await asyncio.sleep(0)  # the cancellation is delivered while the append waits
    output.release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert len(output.lines) == 2
    assert (first.status.value, last.status.value) == ("done", "done") and book.settled()
    assert book.ledger.is_persisted("t.0") and book.ledger.is_persisted("t.1")


async def test_a_group_writer_writes_nothing_until_the_group_is_sealed_then_all_at_once(
    tmp_path: Path,
) -> None:
    book = RolloutBook([TaskRow(0, "t", {"task_id": "t"})], 3, Counts())
    path = tmp_path / "rollouts.jsonl"
    output = DurableAppender(path)
    await output.open()
    try:
        writer = GroupWriter(book, output)
        first, second, last = book.rollouts.values()
        assert await writer.hold(second, second.dropped_line("policy_lag")) is False
        assert await writer.hold(last, last.failed_line()) is False
        await output.drain()
        assert path.read_bytes() == b""
        receipt = pb.ResultReceipt(rollout_id="t.0", attempt=0, result_sha256="cd" * 32)
        assert book.ledger.to_acknowledge() == []
        written = await writer.hold(first, first.finished_line({"reward": 1.0}, receipt), receipt)
        assert written is True
        (owed,) = book.ledger.to_acknowledge()
        assert (owed.rollout_id, owed.result_sha256) == ("t.0", "cd" * 32), "owed once durable"
    finally:
        await output.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["rollout_id"], line["status"]) for line in lines] == [
        ("t.0", "ok"),
        ("t.1", "dropped"),
        ("t.2", "failed"),
    ]
    counts = book.counts
    assert (counts.done, counts.dropped, counts.failed, counts.groups_sealed) == (1, 1, 1, 1)
    assert book.settled()


def test_no_collect_module_reads_the_environment() -> None:
    """Fault injection reaches the collector only through `step_hook` (tests.collect_crash):
    no variable in a user's environment can make a production collector kill itself."""
    package = REPO / "client" / "collect"
    for module in package.glob("*.py"):
        assert not re.search(r"\b(environ|getenv)\b", module.read_text()), module


def test_the_pages_collection_in_one_shell_prints_what_it_shows(tmp_path: Path) -> None:
    """docs/operations.md's collection, as a reader runs it: the example fleet, every rollout
    once, and a `--resume` that finds them all in the output."""
    page_steps = steps(commands(*DOC_SECTIONS[0]))
    assert any("--resume" in step.command for step in page_steps)
    wrong, stderr = differences(page_steps, tmp_path, PAGE_SECONDS)
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"
