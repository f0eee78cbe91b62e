"""`collect` recovers in place when one member of its fleet dies mid-run (issue 15, item 3).

Real processes throughout: the example fleet (scripted policy model, agent, environment,
prompt_injection and counter resources servers), `rollout-checkpoint collect` as a process in
its own group, one member SIGKILLed while rollouts are in flight and its replacement started
closed on the same addresses (as Kubernetes restarts a pod). Without any `--resume`, the
running collector restores its latest checkpoint into the whole fleet (the survivors rejoin)
and finishes: every rollout exactly once, trajectories equal to an uninterrupted run. A member
that keeps dying exhausts `--max-recoveries`: the collector stops with the `--resume` command
(exit 5), and that command finishes the job. A member that only stalled (the same process
back) makes the collector pause, and restores nothing. Waiting on the collector is bounded polling of
the files it writes (`test_collect.wait_until`); the fleet's servers announce themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.client.collect.inputs import TaskRow
from rollout_checkpoint.client.collect.rollouts import RolloutBook, controller_state
from rollout_checkpoint.client.collect.view import Counts
from rollout_checkpoint.examples.demo import (
    Options,
    launch_server,
    signal_group,
    start_fleet,
)
from rollout_checkpoint.examples.demo.comparison import trajectory_of
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .test_collect import (
    LATENCY,
    TOKEN,
    Baseline,
    Fleets,
    RealFleet,
    assert_whole_groups,
    dispatched,
    held_in_entry,
    latest,
    mid_episode,
    output_lines,
    wait_until,
)

RECOVERY_RESTORED = re.compile(r"\[checkpoint_id=recover-[0-9a-f]+\]: restore ok")
"""What a member logs once the in-place recovery's Restore installed the checkpoint."""
FLEETS = 7
"""The fleets this module boots (the baseline's and one per test), two at a time, ahead of
the tests that take them."""


class FleetBoots:
    """Boots this module's fleets in the background, so a test's fleet starts while the test
    before it runs. Quacks like `test_collect.FleetPool` for `test_collect.Fleets`."""

    def __init__(self, work: Path) -> None:
        self.work = work
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.executor = ThreadPoolExecutor(max_workers=2)
        self.booting = [self.executor.submit(self._boot, f"fleet{n}") for n in range(FLEETS)]
        self.started: list[RealFleet] = []

    def take(
        self, *, closed: bool, workers: int = 1, latency: float = LATENCY
    ) -> Future[RealFleet]:
        assert not closed and workers == 1 and latency == LATENCY and self.booting, (
            "this module boots open fleets of one worker and the usual latency only"
        )
        return self.booting.pop(0)

    def _boot(self, label: str) -> RealFleet:
        processes = asyncio.run(
            start_fleet(
                label, self.work / "logs", TOKEN, Options(latency=LATENCY), start_closed=False
            )
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
        for future in self.booting:
            future.cancel()
        self.executor.shutdown(wait=True)
        for fleet in self.started:
            fleet.kill()


@pytest.fixture(scope="module")
def boots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetBoots]:
    pool = FleetBoots(tmp_path_factory.mktemp("recovery-fleets"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def fleets(tmp_path: Path, boots: FleetBoots) -> Iterator[Fleets]:
    manager = Fleets(tmp_path, boots)  # FleetBoots quacks like a FleetPool
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, boots: FleetBoots) -> Baseline:
    """An uninterrupted collection: what every trajectory must equal."""
    work = tmp_path_factory.mktemp("recovery-baseline")
    manager = Fleets(work, boots)
    try:
        process = manager.collect(manager.start().result())
        assert process.wait(timeout=120) == 0, manager.log(process)
        return Baseline(output_lines(work))
    finally:
        manager.close()


def replace(
    fleet: RealFleet, victim: str, label: str, after_kill: Callable[[], None] = lambda: None
) -> float:
    """SIGKILL `victim`, call `after_kill`, and start its replacement closed on the same
    addresses (its old arguments, as `examples/self_heal.py` does); returns when the kill
    happened (`time.monotonic()`)."""
    processes = fleet.processes
    old = processes.servers[victim]
    signal_group(old.process, signal.SIGKILL)
    killed_at = time.monotonic()
    old.process.wait(timeout=30)
    after_kill()
    args = [*old.args, "--http-address", old.http, "--grpc-address", old.grpc, "--start-closed"]
    logs = old.log.parent
    processes.servers[victim] = launch_server(label, logs, old.name, old.kind, args)
    return killed_at


def assert_exactly_once_as_the_baseline(work: Path, baseline: Baseline) -> dict[str, Any]:
    """Every rollout once, collected, with the uninterrupted run's trajectory."""
    lines = output_lines(work)
    ids = [line["rollout_id"] for line in lines]
    expected = {line["rollout_id"]: line for line in baseline.lines}
    assert sorted(ids) == sorted(expected), "each rollout exactly once"
    by_id = {line["rollout_id"]: line for line in lines}
    assert [r for r, line in by_id.items() if line["status"] != "ok"] == []
    differing = [
        r
        for r, line in by_id.items()
        if trajectory_of(line["reply"]) != trajectory_of(expected[r]["reply"])
    ]
    assert differing == [], "trajectories differ from the uninterrupted run"
    sent = dispatched(work)
    assert all(line["attempt"] <= sent[r] for r, line in by_id.items()), "logged before sent"
    return by_id


def first_redispatch_after(work: Path, before: dict[str, int]) -> bool:
    """The dispatch log names an attempt that was not in `before`: dispatching again."""
    return any(a > before.get(r, -1) for r, a in dispatched(work).items())


def stopped(process: subprocess.Popen[bytes]) -> bool:
    """The process is stopped (SIGSTOP): its state in /proc is `T`."""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


@pytest.mark.parametrize("victim", ["agent", "prompt_injection"])
def test_a_member_sigkilled_mid_run_is_recovered_in_place_and_the_run_finishes(
    fleets: Fleets, baseline: Baseline, victim: str
) -> None:
    """The agent: episodes wait at their boundary for it, until the rejoin retires them. The
    resources server: tool calls fail (502) — with `--max-attempts 1` a failure counted
    against a rollout would record it failed at once.

    The collector stops itself (SIGSTOP) once its second checkpoint is published, the fleet
    still closed by it (every episode parked at its boundary), and the member is killed then:
    the rollouts that checkpoint cut are unfinished (bar a reply the environment held), the
    checkpoint's resume fails on the dead member, and the recovery restores exactly that
    checkpoint."""
    work = fleets.work
    fleet = fleets.start().result()
    extra = ["--checkpoint-every", "0.5", "--keep", "1000", "--max-attempts", "1", "--json"]
    process = fleets.collect(fleet, *extra, stop_at="after_latest@2")
    wait_until(lambda: stopped(process), "the collector stopped after its checkpoint", process)
    manifest = latest(work)
    assert manifest is not None
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    cut = {e["rollout_id"]: e["attempt"] for e in manifest["continued"]}
    steps = mid_episode(work, manifest)
    assert set(steps) - finished_before, "the checkpoint cut no unfinished rollout mid-episode"
    sent_before = dispatched(work)
    killed_at = replace(
        fleet, victim, "replacement", lambda: os.killpg(process.pid, signal.SIGCONT)
    )

    wait_until(lambda: first_redispatch_after(work, sent_before), "dispatching again", process)
    redispatched_after = time.monotonic() - killed_at
    assert process.wait(timeout=60) == ExitCode.OK, fleets.log(process)
    log = fleets.log(process)
    print(f"{victim}: {redispatched_after:.2f} s from the SIGKILL to dispatching again")

    by_id = assert_exactly_once_as_the_baseline(work, baseline)
    assert f"recovered in place from checkpoint {manifest['checkpoint_id']}" in log, log
    for server in fleet.processes.servers.values():
        # The whole fleet restored (the survivors rejoining, the replacement fresh), and no
        # member logged a traceback for the connections the crash cut.
        server_log = server.log.read_text()
        assert RECOVERY_RESTORED.search(server_log), f"{server.name} was not restored"
        assert "Traceback" not in server_log, server.name
    assert "Traceback" not in log and "--resume" not in log
    (summary,) = [json.loads(line) for line in fleets.stdout(process).splitlines()]
    assert summary["recoveries"] == 1 and summary["failed"] == 0 and summary["exit_code"] == 0
    # The rollouts the checkpoint cut went on from it as attempt N+1, each from its
    # checkpointed step; the rest ran once or restarted from their inputs.
    went_on = 0
    for rollout_id, attempt in cut.items():
        if rollout_id in finished_before:
            continue
        line = by_id[rollout_id]
        if line["attempt"] == attempt:
            # Its agent had finished it before the kill: the environment still held the
            # reply at the cut and delivered it once the fleet resumed.
            continue
        assert line["attempt"] == attempt + 1, (rollout_id, line["attempt"])
        if rollout_id in steps:
            assert line["reply"]["continued_from_step"] == steps[rollout_id], rollout_id
            went_on += 1
    assert went_on >= 1, "no rollout continued from its checkpointed boundary"


@pytest.mark.slow
def test_group_recovery_in_place_regenerates_every_group_the_loss_cut(
    fleets: Fleets, baseline: Baseline
) -> None:
    """`--group-recovery group`: the agent SIGKILLed while the collector is stopped after its
    second checkpoint. No sibling of a group the loss cut is continued and none is kept: the
    whole group runs again from its inputs as later attempts (or, had its last reply come
    back while the recovery awaited the cut requests, it was written whole before)."""
    work = fleets.work
    fleet = fleets.start().result()
    extra = ["--checkpoint-every", "0.5", "--keep", "1000", "--json", "--group-recovery", "group"]
    process = fleets.collect(fleet, *extra, stop_at="after_latest@2")
    wait_until(lambda: stopped(process), "the collector stopped after its checkpoint", process)
    finished_before = {line["rollout_id"] for line in output_lines(work)}
    sent_before = dispatched(work)
    replace(fleet, "agent", "replacement", lambda: os.killpg(process.pid, signal.SIGCONT))
    assert process.wait(timeout=60) == ExitCode.OK, fleets.log(process)
    by_id = assert_exactly_once_as_the_baseline(work, baseline)
    assert_whole_groups(output_lines(work))
    cut = {r.rsplit(".", 1)[0] for r in sent_before if r not in finished_before}
    regenerated = 0
    for task in cut:
        sent = {r: a for r, a in sent_before.items() if r.rsplit(".", 1)[0] == task}
        later = {r: by_id[r]["attempt"] > a for r, a in sent.items()}
        assert len(set(later.values())) == 1, f"group {task} mixes kept and regenerated: {later}"
        if all(later.values()):
            regenerated += 1
            assert all(by_id[r]["reply"]["continued_from_step"] is None for r in sent), task
    (summary,) = [json.loads(line) for line in fleets.stdout(process).splitlines()]
    assert regenerated >= 1 and summary["groups_regenerated"] >= regenerated


def test_results_acknowledged_after_the_restored_checkpoint_are_acknowledged_again(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The restore brings back the outbox as the checkpoint saw it. Results written before
    that checkpoint and acknowledged after it (the members the loss took released them, the
    ledger forgot them) are held again by the replacements: the recovery acknowledges them
    again, and a completed run leaves nothing held (`certify`'s every_result_acknowledged).
    The first acknowledgement round waits for a checkpoint it asks for
    (`--acknowledge-after-checkpoint`), and the collector stops once that round came back:
    the whole fleet is SIGKILLed and replaced then, as certify's kill_fleet does."""
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(
        fleet,
        "--json",
        stop_at="acknowledged@1",
        crash_flags=["--acknowledge-after-checkpoint"],
    )
    wait_until(lambda: stopped(process), "the first acknowledgement round back", process)
    manifest = latest(work)
    assert manifest is not None
    owed = {r["rollout_id"] for r in manifest["state"]["ledger"]["unacknowledged"]}
    written = {line["rollout_id"] for line in output_lines(work)}
    assert owed and owed <= written, "the checkpoint holds no written, unacknowledged result"
    for member in list(fleet.processes.servers):
        replace(fleet, member, "replacement")
    os.killpg(process.pid, signal.SIGCONT)

    assert process.wait(timeout=120) == ExitCode.OK, fleets.log(process)
    log = fleets.log(process)
    assert f"recovered in place from checkpoint {manifest['checkpoint_id']}" in log, log
    assert_exactly_once_as_the_baseline(work, baseline)
    assert held_in_entry(fleet) == 0, log


def test_a_member_that_keeps_dying_stops_the_run_for_a_resume_that_finishes_it(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The entry point itself (the environment) dies twice with `--max-recoveries 1`: first
    before the run's first checkpoint (nothing to restore: what was in flight restarts from
    its input), then after the checkpoint taken at once after that recovery."""
    work = fleets.work
    fleet = fleets.start().result()
    command = ["--max-recoveries", "1", "--concurrency", "3"]
    process = fleets.collect(fleet, *command)
    wait_until(lambda: len(output_lines(work)) >= 2, "two rollouts", process)
    assert latest(work) is None, "no checkpoint yet"
    replace(fleet, "environment", "replacement-1")
    log = lambda: fleets.log(process)  # noqa: E731
    wait_until(lambda: "recovered in place" in log(), "the first recovery", process)
    assert "no checkpoint yet: nothing to restore" in log()
    wait_until(lambda: latest(work) is not None, "the checkpoint after the recovery", process)
    replace(fleet, "environment", "replacement-2")
    assert process.wait(timeout=60) == ExitCode.UNREACHABLE, log()
    message = log()
    assert re.search(r"lost again after 1 recovery try \(--max-recoveries 1\)", message), message
    assert "stopped WITHOUT a new checkpoint" in message and "--resume" in message
    assert "Traceback" not in message
    stopped_with = output_lines(work)
    assert len(stopped_with) < len(baseline.lines)
    assert len({line["rollout_id"] for line in stopped_with}) == len(stopped_with)
    assert all(line["status"] == "ok" for line in stopped_with)

    resumed = fleets.collect(fleet, *command, "--resume")
    assert resumed.wait(timeout=120) == ExitCode.OK, fleets.log(resumed)
    assert_exactly_once_as_the_baseline(work, baseline)


def test_a_member_that_only_stalled_is_back_as_the_same_process_and_nothing_is_restored(
    fleets: Fleets, baseline: Baseline
) -> None:
    """The policy model SIGSTOPped until the collector sees it down (its probe times out),
    then SIGCONTed: the same process (same boot id) lost nothing, so nothing is restored or
    retired; dispatching resumes and the stalled rollouts finish as their first attempt. (No
    periodic checkpoints: a Prepare sent to a stopped process would wait for its deadline.)"""
    work = fleets.work
    fleet = fleets.start().result()
    process = fleets.collect(fleet)
    wait_until(lambda: len(output_lines(work)) >= 2, "two rollouts", process)
    model = fleet.processes.servers["policy_model"]
    signal_group(model.process, signal.SIGSTOP)
    try:
        seen = "member policy_model is down"
        wait_until(lambda: seen in fleets.log(process), "the stalled member seen down", process)
    finally:
        signal_group(model.process, signal.SIGCONT)
    assert process.wait(timeout=60) == ExitCode.OK, fleets.log(process)
    log = fleets.log(process)
    assert "every member is back as the same process" in log, log
    assert "recover" not in log.replace("0 recovery(ies)", ""), log
    by_id = assert_exactly_once_as_the_baseline(work, baseline)
    assert all(line["attempt"] == 0 for line in by_id.values()), "nothing was redone"


# -- without a fleet -------------------------------------------------------------------------------


def test_the_book_uncounts_what_a_lost_member_cut_and_continues_only_unused_attempts() -> None:
    tasks = [TaskRow(0, "a", {"task_id": "a"}), TaskRow(1, "b", {"task_id": "b"})]
    book = RolloutBook(tasks, 2, Counts())
    book.queue_pending()
    a0, a1, b0, b1 = book.take(4)
    # b.1 failed for real before the loss: retired and sent again as attempt 1.
    book.attempt_failed(b1, "HTTP 500: boom")
    book.retire_queue.remove(b1)
    book.retired(b1, 0)
    book.retry(b1)
    assert book.take(1) == [b1] and b1.attempt == 1
    # a.0's failure reply outruns the watch (a tool call to a resources server that died).
    book.attempt_failed(a0, "HTTP 502: upstream_unreachable")
    assert a0.failures == 1
    book.member_lost()
    assert a0.failures == 0, "a failure not yet retired when the loss is seen is uncounted"
    book.attempt_failed(a1, "HTTP 409: stale_attempt")  # retired by the rejoin
    assert a1.failures == 0, "an attempt sent before the loss is never counted"
    book.collected(b0)
    # The checkpoint cut all four at attempt 0: b.0 finished since, and b.1 used attempt 1.
    cut = [EpisodeId(r, 0) for r in ("a.0", "a.1", "b.0", "b.1")]
    scope = book.continuable(cut)
    assert scope == [EpisodeId("a.0", 0), EpisodeId("a.1", 0)]
    book.installing(scope)
    restart = book.may_run(excluding={"a.0", "a.1"})
    assert restart == [EpisodeId("b.1", 1)], "everything unretired that may still run"
    book.retired(b1, 1)
    book.recovered([e.next_attempt() for e in scope], restart, "ckpt-1")
    assert [(r.rollout_id, r.attempt, r.continued) for r in book.pending] == [
        ("a.0", 1, True),
        ("a.1", 1, True),
        ("b.1", 2, False),
    ]
    assert (a0.restored_from, b1.restored_from) == ([("ckpt-1", 1)], [])
    assert book.retire_queue == [] and (a0.failures, a1.failures, b1.failures) == (0, 0, 1)
    # A later checkpoint may name a restored N+1 not sent yet; the older one may not.
    assert book.continuable([EpisodeId("a.0", 1)]) == [EpisodeId("a.0", 1)]
    assert book.continuable([EpisodeId("a.0", 0)]) == []
    # Sent after the recovery, a failure counts again.
    (sent,) = book.take(1)
    book.attempt_failed(sent, "HTTP 500: boom")
    assert sent.failures == 1


def test_a_rollout_continued_by_two_restores_names_both_checkpoints_across_a_resume() -> None:
    """Provenance `restored_from` is the rollout's own chain: every checkpoint a restore
    continued it from, in order, kept in the controller state across a `--resume`; a rollout
    that restarts from its input starts a new chain."""
    tasks = [TaskRow(0, "a", {"task_id": "a"})]
    book = RolloutBook(tasks, 2, Counts())
    book.queue_pending()
    a0, a1 = book.take(2)
    book.continues(a0, 1, "ckpt-1")
    book.continues(a1, 1, "ckpt-1")
    state = controller_state(
        book, run_id="r", checkpoint_id="ckpt-2", input_digest="d", num_repeats=2, boot_ids={}
    )
    assert state["restored_from"] == {"a.0": [["ckpt-1", 1]], "a.1": [["ckpt-1", 1]]}
    resumed = RolloutBook(tasks, 2, Counts())
    resumed.apply_marks(json.loads(json.dumps(state)))
    r0, r1 = resumed.rollouts["a.0"], resumed.rollouts["a.1"]
    resumed.continues(r0, 2, "ckpt-2")
    resumed.regenerate(r1, 1)  # restarted from its input: a new chain
    receipt = pb.ResultReceipt(rollout_id="a.0", attempt=2, lineage=["ckpt-2", "ckpt-0"])
    line = r0.finished_line({"reward": 1.0}, receipt)
    assert line["provenance"]["restored_from"] == ["ckpt-1", "ckpt-2", "ckpt-0"]
    assert r1.finished_line({"reward": 1.0})["provenance"]["restored_from"] == []
    # Restored as attempt 3 from ckpt-3, but the result came from attempt 2 (it finished
    # after ckpt-3 was taken and was taken back from the entry): ckpt-3 had no part in it.
    resumed.continues(r0, 3, "ckpt-3")
    line = r0.finished_line({"reward": 1.0}, receipt)
    assert line["provenance"]["restored_from"] == ["ckpt-1", "ckpt-2", "ckpt-0"]
