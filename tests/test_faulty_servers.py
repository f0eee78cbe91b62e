"""Each planted bug of examples/faulty/ is real: it loses or duplicates state under a fault.

Real processes: each faulty counter is started from its member's command in the faulty fleet
file (moved to free ports), checkpointed, killed or rejoined, and restored through its sidecar
as a controller would; the requests are real HTTP under rollout prefixes, with the session
cookie the seed set. Every scenario also runs on the honest counter the faulty ones start from
(the fleet's `honest` member), which must come out right: the bug is the override, not the
scenario.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.fleet.launch import LaunchedMember, start_member
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId

from .conftest import TOKEN
from .faulty_fleets import (
    CLI,
    HONEST,
    SCRIPTS_PATH,
    TASKS,
    collect_args,
    free_port_fleet,
    http_url,
    load,
    member,
    run,
    start_fleet,
    stop,
)

WAIT = 60.0
SERVED = ["faulty", "honest"]


@pytest.fixture(autouse=True)
def scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet files' commands run `rollout-checkpoint`: this interpreter's."""
    monkeypatch.setenv("PATH", SCRIPTS_PATH)


def deadline() -> float:
    return time.time() + WAIT


@dataclass
class Counter:
    """A counter member of the faulty fleet, as a controller and an agent reach it."""

    spec: FleetSpec
    member: MemberSpec
    work: Path
    processes: list[LaunchedMember]

    @property
    def url(self) -> str:
        return http_url(self.member)

    async def start(self, *, replacement: bool = False) -> None:
        log = self.work / f"counter-{len(self.processes)}.log"
        launched = await start_member(self.spec, self.member, replacement=replacement, stderr=log)
        self.processes.append(launched)

    async def kill(self) -> None:
        self.processes[-1].kill()
        await self.processes[-1].wait()

    def client(self) -> ParticipantClient:
        return ParticipantClient(self.member.address, TOKEN)

    async def seed(self, capture_key: str, initial: int) -> dict[str, str]:
        """A session seeded as the example agent seeds it; its cookies."""
        async with httpx.AsyncClient(base_url=self.url, timeout=WAIT) as http:
            reply = await http.post(
                f"/ng-rollout/{capture_key}/seed_session",
                json={"environment": {"initial_count": initial}},
            )
        assert reply.status_code == 200, reply.text
        return dict(reply.cookies)

    async def call(
        self, capture_key: str, route: str, body: dict[str, Any], cookies: dict[str, str]
    ) -> Any:
        async with httpx.AsyncClient(base_url=self.url, cookies=cookies, timeout=WAIT) as http:
            reply = await http.post(f"/ng-rollout/{capture_key}/{route}", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def increment(self, capture_key: str, cookies: dict[str, str], *counts: int) -> None:
        for count in counts:
            await self.call(capture_key, "increment_counter", {"count": count}, cookies)

    async def checkpoint(self, checkpoint_id: str, scope: list[EpisodeId]) -> dict[str, Any]:
        """Prepare, commit `scope` into a folder of its own, resume: the exported states,
        session id -> state, as the part's records hold them."""
        directory = self.work / checkpoint_id
        client = self.client()
        try:
            await client.prepare_until_final(checkpoint_id, deadline())
            await client.commit(checkpoint_id, deadline(), str(directory), scope=scope)
            await client.resume(checkpoint_id, deadline())
        finally:
            await client.close()
        return exported_states(directory)

    async def restore(
        self, checkpoint_id: str, restore_id: str, scope: list[EpisodeId], *, rejoin: bool
    ) -> None:
        client = self.client()
        try:
            directory = str(self.work / checkpoint_id)
            await client.restore(restore_id, deadline(), directory, scope=scope, rejoin=rejoin)
            await client.resume(restore_id, deadline())
        finally:
            await client.close()


def exported_states(directory: Path) -> dict[str, Any]:
    states = {}
    for records in directory.rglob("records-*.jsonl"):
        for line in records.read_text().splitlines():
            record = json.loads(line)
            states[record["session_id"]] = record["state"]
    return states


@asynccontextmanager
async def counter_of(bug: str, served: str, tmp_path: Path) -> AsyncIterator[Counter]:
    """The member `bug` of the faulty fleet (or `honest` in its place), started from the fleet
    file's command; every process it ran is killed after."""
    spec = load(free_port_fleet(tmp_path / "fleet"))
    counter = Counter(spec, member(spec, bug if served == "faulty" else HONEST), tmp_path, [])
    await counter.start()
    try:
        yield counter
    finally:
        for launched in counter.processes:
            launched.kill()
            await launched.wait()


def session_of(cookies: dict[str, str], states: dict[str, Any]) -> Any:
    """The state of the one session `cookies` holds (its cookie is signed: the checkpoint is
    read whole and must hold exactly one session)."""
    assert cookies and len(states) == 1, states
    return next(iter(states.values()))


R1, R1_A1 = EpisodeId("r1", 0), EpisodeId("r1", 1)


@pytest.mark.parametrize("served", SERVED)
async def test_dropped_field_loses_the_history_a_checkpoint_carried(
    tmp_path: Path, served: str
) -> None:
    """Checkpointed after two increments, killed, replaced closed, restored, one more
    increment: the honest counter's history is every count; the faulty one's restore
    dropped what came before the checkpoint, though the export wrote it."""
    async with counter_of("dropped_field", served, tmp_path) as counter:
        cookies = await counter.seed("r1", 1)
        await counter.increment("r1", cookies, 1, 2)
        stored = session_of(cookies, await counter.checkpoint("ckpt-1", [R1]))
        assert stored == {"count": 4, "history": [2, 4]}  # the export is right
        await counter.kill()
        await counter.start(replacement=True)
        await counter.restore("ckpt-1", "restore-1", [R1], rejoin=False)
        await counter.increment("r1-a1", cookies, 3)
        after = session_of(cookies, await counter.checkpoint("ckpt-2", [R1_A1]))
    expected_history = [7] if served == "faulty" else [2, 4, 7]
    assert after == {"count": 7, "history": expected_history}


@pytest.mark.parametrize("served", SERVED)
async def test_restore_not_idempotent_doubles_a_survivors_count(
    tmp_path: Path, served: str
) -> None:
    """A survivor's rejoining Restore (another member died): it retires the session it holds
    and installs the checkpoint's. The honest counter is back at the checkpoint's count; the
    faulty one added the checkpoint's count to the one it kept."""
    async with counter_of("restore_not_idempotent", served, tmp_path) as counter:
        cookies = await counter.seed("r1", 1)
        await counter.increment("r1", cookies, 1, 2)
        assert session_of(cookies, await counter.checkpoint("ckpt-1", [R1]))["count"] == 4
        await counter.increment("r1", cookies, 3)  # after the checkpoint: rolled back
        await counter.restore("ckpt-1", "restore-1", [R1], rejoin=True)
        await counter.increment("r1-a1", cookies, 3)
        after = session_of(cookies, await counter.checkpoint("ckpt-2", [R1_A1]))
        verified = await counter.call("r1-a1", "verify", {"expected_count": 7}, cookies)
    count = 4 + 7 + 3 if served == "faulty" else 7
    assert after["count"] == count and after["history"] == [2, 4, count]
    assert verified == {**after, "reward": 1.0 if served == "honest" else 0.0}


async def exports_until(
    counter: Counter, cookies: dict[str, str], changed: Callable[[Any], bool]
) -> list[Any]:
    """Checkpoint the idle session again and again (no request in between) until `changed`
    holds for an export, ten times at most; every export taken."""
    exports = []
    for number in range(2, 12):
        states = await counter.checkpoint(f"ckpt-{number}", [R1])
        exports.append(session_of(cookies, states))
        if changed(exports[-1]):
            break
    return exports


@pytest.mark.parametrize("served", SERVED)
async def test_background_mutation_changes_a_session_no_request_touched(
    tmp_path: Path, served: str
) -> None:
    """No request after the seed and one increment, yet the faulty counter's exported state
    keeps changing from one checkpoint to the next (a background task the runtime never
    sees); the honest counter's stays what the requests made it."""
    async with counter_of("background_mutation", served, tmp_path) as counter:
        cookies = await counter.seed("r1", 1)
        await counter.increment("r1", cookies, 1)
        first = session_of(cookies, await counter.checkpoint("ckpt-1", [R1]))
        exports = await exports_until(counter, cookies, lambda state: state != first)
    if served == "faulty":
        assert {k: v for k, v in first.items() if k != "idle_ticks"} == {
            "count": 2,
            "history": [2],
        }
        assert exports[-1]["idle_ticks"] > first["idle_ticks"], exports
    else:
        assert first == {"count": 2, "history": [2]}
        assert exports == [first] * 10  # ten checkpoints later, not a field moved


@pytest.mark.parametrize("served", SERVED)
async def test_hidden_state_answers_the_same_request_differently(
    tmp_path: Path, served: str
) -> None:
    """The same request in two fresh sessions of one process: a stateless server must answer
    it the same; the faulty one counts across sessions."""
    async with counter_of("hidden_state", served, tmp_path) as counter:
        replies = []
        for rollout in ("p1", "p2"):
            cookies = await counter.seed(rollout, 1)
            replies.append(await counter.call(rollout, "increment_counter", {"count": 5}, cookies))
        client = counter.client()
        try:
            participant = await client.get_participant()
        finally:
            await client.close()
    mode = participant.facts["mode"]
    if served == "faulty":
        assert mode == "stateless" and replies == [{"count": 5}, {"count": 10}]
    else:
        assert mode == "exported" and replies == [{"success": True}] * 2


@pytest.mark.parametrize("served", SERVED)
async def test_side_effect_file_applies_a_replayed_call_twice(tmp_path: Path, served: str) -> None:
    """Checkpointed after the first increment; the second reaches the server, then it is
    killed; the restored episode re-issues the second (its boundary is before it), then the
    rest. The in-memory count is right either way; the faulty counter's ledger, outside the
    process, holds the second increment twice, and its verification reads the ledger."""
    async with counter_of("side_effect_file", served, tmp_path) as counter:
        cookies = await counter.seed("r1", 1)
        await counter.increment("r1", cookies, 1)
        await counter.checkpoint("ckpt-1", [R1])
        await counter.increment("r1", cookies, 2)
        await counter.kill()
        await counter.start(replacement=True)
        await counter.restore("ckpt-1", "restore-1", [R1], rejoin=False)
        await counter.increment("r1-a1", cookies, 2, 3, 4)
        state = session_of(cookies, await counter.checkpoint("ckpt-2", [R1_A1]))
        verified = await counter.call("r1-a1", "verify", {"expected_count": 11}, cookies)
    assert state == {"count": 11, "history": [2, 4, 7, 11]}
    ledger = tmp_path / "fleet" / "outside" / "side_effect_file" / "ledger.jsonl"
    if served == "faulty":
        assert [json.loads(line)["count"] for line in ledger.read_text().splitlines()] == [
            1,
            1,
            2,
            2,
            3,
            4,
        ]
        assert verified == {"reward": 0.0, "count": 13}
    else:
        assert not ledger.exists() and verified == {**state, "reward": 1.0}


CRASHING_CLI = [sys.executable, "-m", "tests.collect_crash"]


TRIES = 4
"""Crash-and-resume runs a test makes until one continues an episode (see below)."""
MODEL_LATENCY = "0.15"
"""Seconds per scripted generation in the crash-and-resume fleet: an episode (eight steps)
then lasts over a second, so the first batch of episodes is mid-episode at both the first
checkpoint (0.3 s in) and the second, where the crash comes. With the default 0.05 s an
episode ended between the two on a quiet machine, which left nothing to continue: 2 runs
in 5 failed all their tries."""


def slow_model(fleet: Path) -> None:
    """The policy model of `fleet` generates at `MODEL_LATENCY` (see there)."""
    text = fleet.read_text()
    tasks = '"--tasks", "tasks.jsonl",'
    assert text.count(tasks) == 1, "the policy model's command changed"
    fleet.write_text(text.replace(tasks, f'{tasks} "--latency", "{MODEL_LATENCY}",'))


async def crashed_and_resumed(fleet: Path, work: Path) -> list[dict[str, Any]]:
    """`collect` SIGKILLed once its second checkpoint prepared the fleet (closed, holding
    what the episodes did since the first, `LATEST`), then `collect --resume`: the output
    rows; none when the collection finished before that checkpoint came (a slow machine)."""
    work.mkdir()
    args = collect_args(fleet, work, "--checkpoint-every", "0.3")
    crashed = await asyncio.to_thread(
        run, [*CRASHING_CLI, "--crash-at", "prepared@2", *args], WAIT * 3
    )
    if crashed.returncode == 0:
        return []
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = await asyncio.to_thread(run, [*CLI, *args, "--resume"], WAIT * 3)
    assert resumed.returncode == 0, resumed.stderr
    return [json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()]


RECOVERY_BUGS = ("restore_not_idempotent", "side_effect_file")
"""The bugs a crashed and resumed collection meets on its own (the others need certify's
second baseline pass or its fresh-process probe)."""


def continued_by_member(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The continued rollouts of a run, by the resources member their task names."""
    served = {task["task_id"]: task["resources_server"] for task in tasks()}
    continued: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["reply"]["continued_from_step"] is not None:
            continued.setdefault(served[row["task_id"]], []).append(row)
    return continued


def tasks() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TASKS.read_text().splitlines()]


async def test_the_products_own_recovery_meets_the_bugs(tmp_path: Path) -> None:
    """The whole faulty fleet and its tasks under `collect`, SIGKILLed while its second
    checkpoint is under way, then `collect --resume`: the rejoining Restore rolls every
    survivor back to the first (`LATEST`) and continues the episodes it caught, which
    re-issue the tool calls they made since. Every rollout of the honest counter is rewarded
    as an uninterrupted one is; some continued rollout of each faulty one is not (a
    survivor's count doubled; increments replayed into the ledger a second time). This is
    the path a certify trial killing the collector takes.

    A resume may also restart the caught episodes from their inputs instead, with the reason
    it gives (a rejoining Restore the policy model refused, "restore needs a model process
    that has not served calls", was seen in about one run in four), or finish before the
    crash point on a slow machine: such a run proves nothing either way, and the scenario
    runs again on the same fleet, `TRIES` times at most, until one continued an episode of
    each of the two faulty counters and of the honest one."""
    fleet = free_port_fleet(tmp_path / "fleet")
    slow_model(fleet)
    spec = load(fleet)
    launched = await start_fleet(spec, tmp_path / "logs")
    wanted = (*RECOVERY_BUGS, HONEST)
    try:
        for number in range(TRIES):
            rows = await crashed_and_resumed(fleet, tmp_path / f"run-{number}")
            continued = continued_by_member(rows)
            if all(name in continued for name in wanted):
                break
    finally:
        await stop(launched)
    assert all(name in continued for name in wanted), f"no run of {TRIES} continued {wanted}"
    assert sorted(row["rollout_id"] for row in rows) == sorted(
        f"{task['task_id']}.0" for task in tasks()
    )
    for bug in RECOVERY_BUGS:
        assert any(row["reward"] == 0.0 for row in continued[bug]), continued[bug]
    honest = {task["task_id"] for task in tasks() if task["resources_server"] == HONEST}
    assert all(row["reward"] == 1.0 for row in rows if row["task_id"] in honest), rows
