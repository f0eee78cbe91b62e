"""Servers with several workers (`serve <kind> --workers N`): still one participant.

Real processes: a main process (control plane, sidecar, the one HTTP port) and 3 worker
processes, in a process group of their own, SIGKILLed as a group. Every request goes out on
a fresh connection, so the kernel hands it to an arbitrary worker: a session's requests
reach the worker that owns it only through the cookie routing, and an environment's
replacement run reaches whichever worker accepts it, which claims the restored record.
Waits on a real process are bounded polls of its status (`until`), never bare sleeps.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import itertools
import json
import os
import signal
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, refused, serve_app
from .doc_pages import commands
from .doc_steps import differences, steps
from .loop_thread import only_when_asked_for
from .processes import kill_group, started

DOC_SECTIONS = [("docs/your-server.md", "Several workers per server")]
PAGE_SECONDS = 240
WORKERS = 3
WAIT = 60.0
COOKIE = "rollout_session"
SESSION_KEY = "rollout_checkpoint.session_id"
PREPARED = types_pb2.PARTICIPANT_STATE_PREPARED
WORKER_LOST = types_pb2.BLOCKER_REASON_WORKER_LOST
WORKER_MISSING = types_pb2.BLOCKER_REASON_WORKER_MISSING


class Served:
    """One `serve --workers N` process group and what it announced."""

    def __init__(self, process: Any, announced: dict[str, Any]) -> None:
        self.process = process
        self.announced = announced
        self.base_url = f"http://{announced['http']}"

    @functools.cached_property
    def client(self) -> ParticipantClient:
        """Made on first use, in the test's event loop (the server may start in a thread)."""
        return ParticipantClient(self.announced["grpc"], TOKEN)


@pytest.fixture
def serve_workers(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Starts `serve <args> --workers N` (N = 1: the one-process server); blocking, so
    several start at once from threads (`asyncio.to_thread`)."""
    groups: list[Served] = []
    names = itertools.count()

    def start(*args: str, workers: int = WORKERS) -> Served:
        log = tmp_path / f"serve-{next(names)}.log"
        env = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
        command = [sys.executable, "-m", "rollout_checkpoint.examples.serve", *args]
        process, announced = started(
            [*command, "--workers", str(workers), "--log-level", "info"], env=env, log=log
        )
        served = Served(process, announced)
        groups.append(served)
        return served

    try:
        yield start
    finally:
        for served in groups:
            kill_group(served.process)


def deadline(seconds: float = WAIT) -> float:
    return time.time() + seconds


async def until(predicate: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll an async predicate until it returns something truthy, at most `timeout` s."""
    end = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def post(
    base_url: str, path: str, body: Any, cookies: dict[str, str] | None = None
) -> httpx.Response:
    """A request on a connection of its own: whichever worker accepts it gets it. Plain
    HTTP on the loopback: `verify=False` only skips loading the CA bundle, 25 ms of CPU per
    client on this machine, which hundreds of requests would pay for nothing."""
    async with httpx.AsyncClient(
        base_url=base_url, cookies=cookies, timeout=WAIT, verify=False
    ) as http:
        return await http.post(path, json=body)


def owner_of(cookie: str, workers: int = WORKERS) -> int:
    """The worker that holds the session of a signed session cookie (its payload is base64
    JSON): CRC-32 of the session id, modulo the worker count."""
    payload = cookie.split(".")[0]
    session = json.loads(base64.b64decode(payload + "=" * (-len(payload) % 4)))
    return zlib.crc32(session[SESSION_KEY].encode()) % workers


def part_records(checkpoint_dir: str, kind: str, instance: str) -> list[dict[str, Any]]:
    part = Path(checkpoint_dir, "participants", kind, instance)
    manifest = json.loads((part / "manifest.json").read_text())
    lines = (part / manifest["records_file"]).read_text().splitlines()
    return [json.loads(line) for line in lines]


def counted(count: int) -> bytes:
    """`get_counter_value`'s reply body (JSONResponse renders compact JSON)."""
    return b'{"count":%d}' % count


def blocker_reasons(status: Any) -> list[int]:
    return sorted(b.reason for b in status.readiness.blockers)


def test_the_pages_workers_block_prints_what_it_shows(tmp_path: Path) -> None:
    """docs/your-server.md's example, as a reader runs it: four workers, one participant that
    counts them at its Prepare and commits one part."""
    page_steps = steps(commands(*DOC_SECTIONS[0]))
    assert any("--workers 4" in step.command for step in page_steps)
    wrong, stderr = differences(page_steps, tmp_path, PAGE_SECONDS)
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"


# -- resources: cookie routing, checkpoint, SIGKILL, restore, continue -------------------


SEED_BATCH = 2 * WORKERS
SEEDS_AT_MOST = 360


async def seed_on_every_worker(base_url: str) -> dict[str, dict[str, str]]:
    """Seed counter sessions (rollout r<i>, initial count i) until every worker owns at
    least two; returns rollout -> cookies.

    The workers share one accept queue (workers.py), and on a quiet machine the worker
    woken first takes nearly every connection (60 seeds one at a time once gave 52/7/1, and
    a full run failed there). Seeds go in concurrent batches, each on a connection of its
    own, so a worker busy with one leaves the next to another, up to `SEEDS_AT_MOST`."""
    sessions: dict[str, dict[str, str]] = {}
    owners: dict[int, int] = {}
    for start in range(0, SEEDS_AT_MOST, SEED_BATCH):
        numbers = range(start, start + SEED_BATCH)
        replies = await asyncio.gather(
            *(
                post(base_url, f"/ng-rollout/r{i}/seed_session", {"initial_count": i})
                for i in numbers
            )
        )
        for i, reply in zip(numbers, replies, strict=True):
            assert reply.status_code == 200, reply.text
            cookie = reply.cookies[COOKIE]
            sessions[f"r{i}"] = {COOKIE: cookie}
            owners[owner_of(cookie)] = owners.get(owner_of(cookie), 0) + 1
        if len(owners) == WORKERS and min(owners.values()) >= 2:
            return sessions
    raise AssertionError(f"{SEEDS_AT_MOST} seeds did not reach every worker twice: {owners}")


async def test_resources_workers_checkpoint_sigkill_restore_continue(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> None:
    checkpoint_dir = str(tmp_path / "ckpt")
    first = serve_workers("counter")
    assert first.announced["workers"] == WORKERS
    sessions = await seed_on_every_worker(first.base_url)
    expected: dict[str, int] = {}
    for rollout, cookies in sessions.items():
        start = int(rollout[1:])
        # Three increments, each on a connection of its own: two in three land on a worker
        # that does not own the session and must be forwarded to it.
        for step in (1, 2, 3):
            reply = await post(
                first.base_url, f"/ng-rollout/{rollout}/increment_counter", {"count": step}, cookies
            )
            assert reply.status_code == 200, reply.text
        expected[rollout] = start + 6
        reply = await post(first.base_url, f"/ng-rollout/{rollout}/get_counter_value", {}, cookies)
        assert reply.content == counted(expected[rollout])  # as the owner answers it
    client = first.client
    final = await client.prepare_until_final("ckpt-1", deadline())
    assert final.state == PREPARED
    assert final.readiness.counts["workers"] == WORKERS
    assert final.readiness.counts["sessions"] == len(sessions)
    scope = [EpisodeId(rollout, 0) for rollout in sessions]
    committed = await client.commit("ckpt-1", deadline(), checkpoint_dir, scope=scope)
    assert sorted(committed.exported) == sorted(sessions)
    records = part_records(checkpoint_dir, "resources", "counter")
    assert len(records) == len(sessions)  # one part, every worker's sessions in it
    for record in records:
        rollout = record["episode_id"]["rollout_id"]
        assert set(record) == {"episode_id", "session_id", "state"}  # as one process writes
        assert record["state"] == {"count": expected[rollout]}
    await client.resume("ckpt-1", deadline())
    await client.close()
    kill_group(first.process)  # the main process and every worker
    assert first.process.returncode == -signal.SIGKILL

    fresh = serve_workers("counter", "--start-closed")
    client = fresh.client
    restored = await client.restore("restore-1", deadline(), checkpoint_dir, scope=scope)
    assert sorted(restored.restored) == sorted(f"{r}-a1" for r in sessions)
    pending = [e.capture_key for e in await client.all_episodes() if e.restored_pending]
    assert sorted(pending) == sorted(f"{r}-a1" for r in sessions)
    await client.resume("restore-1", deadline())
    for rollout, cookies in sessions.items():
        key = f"{rollout}-a1"
        reply = await post(fresh.base_url, f"/ng-rollout/{key}/get_counter_value", {}, cookies)
        assert reply.status_code == 200, reply.text
        assert reply.content == counted(expected[rollout])  # byte for byte, as before the crash
        reply = await post(
            fresh.base_url, f"/ng-rollout/{key}/increment_counter", {"count": 4}, cookies
        )
        assert reply.status_code == 200, reply.text
        reply = await post(
            fresh.base_url,
            f"/ng-rollout/{key}/verify",
            {"expected_count": expected[rollout] + 4},
            cookies,
        )
        assert reply.json()["reward"] == 1.0, reply.text
    assert await _pending(client) == 0  # every session was claimed, as GetStatus reads it
    await client.close()


# -- a checkpoint taken with N workers restores into M: every pair of 1..4 ---------------

WORKER_COUNTS = (1, 2, 3, 4)
SEEDED = 8


@dataclass
class Taken:
    """A checkpoint of `SEEDED` counter sessions taken by a server with `workers` workers
    (its own rollouts, so one target can restore several of them in turn)."""

    workers: int
    directory: str
    sessions: dict[str, dict[str, str]]
    """rollout -> its cookies, as the seed set them."""
    counts: dict[str, int]
    """rollout -> the count it held at the checkpoint."""
    attempt: int = 0
    """The attempt checkpointed (1: sessions restored once, then checkpointed again)."""

    @property
    def name(self) -> str:
        return f"{self.workers}-a{self.attempt}"

    @property
    def scope(self) -> list[EpisodeId]:
        return [EpisodeId(rollout, self.attempt) for rollout in self.sessions]


async def commit_sessions(served: Served, taken: Taken) -> None:
    """Prepare, and Commit `taken`'s sessions into its directory."""
    client = served.client
    final = await client.prepare_until_final(f"ckpt-{taken.name}", deadline())
    assert final.state == PREPARED, final
    committed = await client.commit(
        f"ckpt-{taken.name}", deadline(), taken.directory, scope=taken.scope
    )
    assert sorted(committed.exported) == sorted(e.capture_key for e in taken.scope)
    for record in part_records(taken.directory, "resources", "counter"):
        # The kind's own record, whatever the worker count: what one process writes.
        assert set(record) == {"episode_id", "session_id", "state"}, record


async def take_checkpoint(served: Served, workers: int, directory: str) -> Taken:
    """Seed and increment `SEEDED` sessions, each request on a connection of its own (so
    each lands on an arbitrary worker), then Prepare and Commit them; SIGKILL."""
    sessions: dict[str, dict[str, str]] = {}
    counts: dict[str, int] = {}
    for i in range(SEEDED):
        rollout = f"w{workers}r{i}"
        reply = await post(
            served.base_url, f"/ng-rollout/{rollout}/seed_session", {"initial_count": i}
        )
        assert reply.status_code == 200, reply.text
        sessions[rollout] = {COOKIE: reply.cookies[COOKIE]}
        reply = await post(
            served.base_url,
            f"/ng-rollout/{rollout}/increment_counter",
            {"count": 10 * workers},
            sessions[rollout],
        )
        assert reply.status_code == 200, reply.text
        counts[rollout] = i + 10 * workers
    taken = Taken(workers, directory, sessions, counts)
    await commit_sessions(served, taken)
    await served.client.close()
    kill_group(served.process)
    return taken


async def restore_and_continue(target: Served, taken: Taken, *, rejoin: bool) -> None:
    """Restore `taken` into `target` (a `--start-closed` server, or with `rejoin` one that
    already restored another checkpoint), resume, and continue every session through its
    old cookie as the next attempt: the state as checkpointed, then an increment its owner
    keeps."""
    client = target.client
    restore_id = f"restore-{taken.name}"
    restored = await client.restore(
        restore_id, deadline(), taken.directory, scope=taken.scope, rejoin=rejoin
    )
    keys = {rollout: f"{rollout}-a{taken.attempt + 1}" for rollout in taken.sessions}
    assert sorted(restored.restored) == sorted(keys.values())
    await client.resume(restore_id, deadline())
    assert (await client.get_status()).readiness.counts["sessions"] == SEEDED
    for rollout, cookies in taken.sessions.items():
        key = keys[rollout]
        reply = await post(target.base_url, f"/ng-rollout/{key}/get_counter_value", {}, cookies)
        assert reply.status_code == 200, (taken.name, reply.text)
        assert reply.content == counted(taken.counts[rollout]), (taken.name, rollout)
        reply = await post(
            target.base_url, f"/ng-rollout/{key}/increment_counter", {"count": 1}, cookies
        )
        assert reply.status_code == 200, reply.text
        reply = await post(target.base_url, f"/ng-rollout/{key}/get_counter_value", {}, cookies)
        assert reply.content == counted(taken.counts[rollout] + 1), (taken.name, rollout)


async def take_every_checkpoint(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> dict[int, Taken]:
    """One checkpoint per worker count, the servers started and driven concurrently."""
    sources = await asyncio.gather(
        *(asyncio.to_thread(serve_workers, "counter", workers=n) for n in WORKER_COUNTS)
    )
    taken = await asyncio.gather(
        *(
            take_checkpoint(source, n, str(tmp_path / f"taken-{n}"))
            for n, source in zip(WORKER_COUNTS, sources, strict=True)
        )
    )
    return {t.workers: t for t in taken}


async def start_closed(serve_workers: Callable[..., Served], counts: Sequence[int]) -> list[Served]:
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(serve_workers, "counter", "--start-closed", workers=m)
                for m in counts
            )
        )
    )


async def test_a_checkpoint_of_n_workers_restores_into_m_for_every_pair_of_1_to_4(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> None:
    """Every (N, M) of 1..4, both ways. One server per count takes a checkpoint; one fresh
    `--start-closed` server per count restores one of them (a different N for each M, the
    issue's 3 -> 1 among them) and then the other three by rejoining Restores, which install
    through the same path. 8 servers, not 16 + 4: they start slowly on a loaded machine."""
    taken = await take_every_checkpoint(serve_workers, tmp_path)
    targets = await start_closed(serve_workers, WORKER_COUNTS)

    async def restore_each(m: int, target: Served) -> Taken:
        """Restores every checkpoint into target M; returns the one it holds at the end."""
        first = FIRST_RESTORED_INTO[m]
        await restore_and_continue(target, taken[first], rejoin=False)
        rest = [n for n in WORKER_COUNTS if n != first]
        for n in rest:
            await restore_and_continue(target, taken[n], rejoin=True)
        return taken[rest[-1]]

    held = await asyncio.gather(
        *(restore_each(m, t) for m, t in zip(WORKER_COUNTS, targets, strict=True))
    )
    # Restored sessions checkpointed again restore again: their ids came from a server of
    # another worker count, and nothing but the id says where they go. 3 workers -> 2.
    by_three = held[WORKER_COUNTS.index(3)]
    again = Taken(
        3,
        str(tmp_path / "again"),
        by_three.sessions,
        {rollout: count + 1 for rollout, count in by_three.counts.items()},
        attempt=1,
    )
    await commit_sessions(targets[WORKER_COUNTS.index(3)], again)
    await restore_and_continue(targets[WORKER_COUNTS.index(2)], again, rejoin=True)
    for target in targets:
        await target.client.close()


FIRST_RESTORED_INTO = {1: 3, 2: 4, 3: 1, 4: 2}
"""Target M's first (fresh-process) restore: the checkpoint of N workers."""


@pytest.mark.slow
async def test_a_checkpoint_of_n_workers_restores_into_a_fresh_m_for_every_pair(
    serve_workers: Callable[..., Served], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The fuller variant: each of the 16 pairs into a fresh process of its own."""
    only_when_asked_for(request)
    taken = await take_every_checkpoint(serve_workers, tmp_path)
    for n in WORKER_COUNTS:
        targets = await start_closed(serve_workers, WORKER_COUNTS)
        await asyncio.gather(*(restore_and_continue(t, taken[n], rejoin=False) for t in targets))
        for target in targets:
            await target.client.close()
            kill_group(target.process)


# -- the counts of several workers are exact -------------------------------------------------


async def test_counts_across_workers_are_exact_once_no_request_is_in_flight(
    serve_workers: Callable[..., Served],
) -> None:
    """A controller reads GetStatus right after the data plane's last reply: the sessions
    and requests of every worker are counted, none missing and none left over, and ended
    ones leave the count at once. Keep-alive connections (one per session) make requests
    fast enough to end well inside a worker's push interval."""
    served = serve_workers("counter")
    client = served.client
    seeded = 12
    https = [
        httpx.AsyncClient(base_url=served.base_url, timeout=WAIT, verify=False)
        for _ in range(seeded)
    ]
    try:

        async def exact(sessions: int) -> None:
            status = await client.get_status()
            counts = dict(status.readiness.counts)
            assert counts == {"workers": WORKERS, "sessions": sessions, "inflight": 0}, counts
            assert status.readiness.blocker_count == 0

        for i, http in enumerate(https):
            reply = await http.post(f"/ng-rollout/c{i}/seed_session", json={"initial_count": i})
            assert reply.status_code == 200, reply.text
        await exact(seeded)
        for step in range(1, 4):
            for i, http in enumerate(https):
                reply = await http.post(f"/ng-rollout/c{i}/increment_counter", json={"count": 1})
                assert reply.status_code == 200, reply.text
                reply = await http.post(f"/ng-rollout/c{i}/get_counter_value", json={})
                assert reply.content == counted(i + step)
            await exact(seeded)
        for i, http in enumerate(https[:4]):
            reply = await http.post(f"/ng-rollout/c{i}/close_session", json={})
            assert reply.status_code == 200, reply.text
            await exact(seeded - i - 1)
        await client.retire("retire-1", deadline(), [EpisodeId("c4")])
        await exact(seeded - 5)
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
        await client.close()


# -- a worker missing or lost: its own blockers -------------------------------------------


async def test_missing_worker_blocks_prepare_and_a_worker_lost_while_closed_until_resume(
    serve_workers: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve_workers("counter")
    client = served.client
    sessions = await seed_on_every_worker(served.base_url)
    pids = served.announced["worker_pids"]

    async def workers_running() -> int:
        return int((await client.get_status()).readiness.counts["workers"])

    # A worker that died while open: Prepare is blocked WORKER_MISSING (fewer workers than
    # configured) until the main process restarted it; the restart reaches the Prepare
    # stream without any request, and the stream ends PREPARED.
    os.kill(pids[0], signal.SIGKILL)
    await until(lambda: _equals(workers_running(), WORKERS - 1), "the loss to be seen")
    updates = [u async for u in client.prepare("p1", deadline())]
    assert WORKER_MISSING in [b.reason for b in updates[0].readiness.blockers]
    assert not updates[0].readiness.ready
    assert updates[-1].final and updates[-1].state == PREPARED
    assert updates[-1].readiness.counts["workers"] == WORKERS
    # The restarted worker lost its sessions (they lived in its memory): the others remain.
    survivors = [r for r, c in sessions.items() if owner_of(c[COOKIE]) != 0]
    assert updates[-1].readiness.counts["sessions"] == len(survivors)

    # A worker lost while the checkpoint is open: WORKER_LOST until Resume, even once its
    # replacement is back and reported closed (a late joiner closes at once: no
    # WORKER_MISSING for it); Commit is refused, nothing written.
    os.kill(pids[1], signal.SIGKILL)

    async def lost_and_back() -> bool:
        status = await client.get_status()
        return (
            blocker_reasons(status) == [WORKER_LOST]
            and status.readiness.counts["workers"] == WORKERS
        )

    await until(lost_and_back, "WORKER_LOST with every worker back")
    await refused(client.commit("p1", deadline(), str(tmp_path / "ckpt")), "INVALID_PHASE")
    assert not (tmp_path / "ckpt" / "participants").exists()
    await client.resume("p1", deadline())
    final = await client.prepare_until_final("p2", deadline())
    assert final.state == PREPARED, final
    committed = await client.commit("p2", deadline(), str(tmp_path / "ckpt2"))
    alive = [r for r, c in sessions.items() if owner_of(c[COOKIE]) == 2]
    assert sorted(committed.exported) == sorted(alive)
    await client.close()

    # A worker whose main process died stops itself: nobody could close it for a checkpoint.
    os.kill(served.process.pid, signal.SIGKILL)

    async def worker_gone() -> bool:
        return not running(pids[2])

    await until(worker_gone, "the orphaned worker to stop")


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def _pending(client: ParticipantClient) -> int:
    return int((await client.get_status()).restored_pending)


# -- environment: episodes on every worker, claims after restore -------------------------


class StubAgent:
    """An agent whose `/run` waits for `gate`; its reply depends only on the task, so a
    continued run answers byte for byte as an uninterrupted one."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.arrived: list[str] = []

    def app(self) -> Starlette:
        async def run(request: Request) -> JSONResponse:
            self.arrived.append(request.path_params["key"])
            body = await request.json()
            await self.gate.wait()
            return JSONResponse({"answer": body["task"]["question"].upper(), "reward": 1.0})

        return Starlette(routes=[Route("/ng-rollout/{key}/run", run, methods=["POST"])])


@pytest.fixture
async def stub_agent() -> AsyncIterator[tuple[StubAgent, str]]:
    agent = StubAgent()
    server, serving, port = await serve_app(agent.app())
    try:
        yield agent, f"http://127.0.0.1:{port}"
    finally:
        agent.gate.set()
        server.should_exit = True
        await serving


def task(i: int) -> dict[str, Any]:
    return {"question": f"q{i}", "id": i}


async def test_environment_workers_checkpoint_sigkill_restore_claims_continue(
    serve_workers: Callable[..., Served],
    stub_agent: tuple[StubAgent, str],
    tmp_path: Path,
) -> None:
    agent, agent_url = stub_agent
    runs = 24
    first = serve_workers("environment", "--agent-url", agent_url)
    # The uninterrupted baseline: the same tasks, run to the end.
    agent.gate.set()
    baseline = {}
    for i in range(3):
        reply = await post(first.base_url, f"/ng-rollout/base{i}/run", {"task": task(i)})
        assert reply.status_code == 200, reply.text
        baseline[i] = reply.content
    agent.gate.clear()
    agent.arrived.clear()
    # One run at a time, each on its own connection, the next sent once the previous reached
    # the agent: every worker then races for a single connection per wake-up. A burst would
    # let the first worker awake accept all of them at once (asyncio accepts in a loop), and
    # the other workers would hold nothing.
    in_flight = []
    for i in range(runs):
        in_flight.append(
            asyncio.ensure_future(
                post(first.base_url, f"/ng-rollout/r{i}/run", {"task": task(i % 3)})
            )
        )

        async def arrived(count: int = i + 1) -> bool:
            return len(agent.arrived) == count

        await until(arrived, f"run r{i} to reach the agent")
    client = first.client
    final = await client.prepare_until_final("ckpt-1", deadline())
    assert final.state == PREPARED, final
    scope = [EpisodeId(f"r{i}", 0) for i in range(runs)]
    checkpoint_dir = str(tmp_path / "ckpt")
    committed = await client.commit("ckpt-1", deadline(), checkpoint_dir, scope=scope)
    assert len(committed.exported) == runs
    records = part_records(checkpoint_dir, "environment", "environment")
    assert all(set(r) == {"episode_id", "task_digest", "boundary"} for r in records)
    await client.close()
    kill_group(first.process)
    await asyncio.gather(*in_flight, return_exceptions=True)

    fresh = serve_workers("environment", "--agent-url", agent_url, "--start-closed")
    client = fresh.client
    await client.restore("restore-1", deadline(), checkpoint_dir, scope=scope)
    pending = sorted(e.capture_key for e in await client.all_episodes() if e.restored_pending)
    assert pending == sorted(f"r{i}-a1" for i in range(runs))
    await client.resume("restore-1", deadline())

    # A checkpoint before any replacement ran exports every unclaimed record again, under
    # its attempt N+1, unchanged.
    assert (await client.prepare_until_final("ckpt-2", deadline())).state == PREPARED
    second_dir = str(tmp_path / "ckpt2")
    await client.commit(
        "ckpt-2", deadline(), second_dir, scope=[EpisodeId(f"r{i}", 1) for i in range(runs)]
    )

    def without_id(record: dict[str, Any]) -> tuple[str, str]:
        rest = {k: v for k, v in record.items() if k != "episode_id"}
        return record["episode_id"]["rollout_id"], json.dumps(rest)

    again = part_records(second_dir, "environment", "environment")
    assert sorted(map(without_id, again)) == sorted(map(without_id, records))
    assert {r["episode_id"]["attempt"] for r in again} == {1}
    # While the checkpoint is open a replacement cannot claim its record.
    reply = await post(fresh.base_url, "/ng-rollout/r0-a1/run", {"task": task(0)})
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "admission_closed"
    await client.resume("ckpt-2", deadline())

    agent.gate.set()
    replies = await asyncio.gather(
        *(
            post(fresh.base_url, f"/ng-rollout/r{i}-a1/run", {"task": task(i % 3)})
            for i in range(runs)
        )
    )
    for i, reply in enumerate(replies):
        assert reply.status_code == 200, reply.text
        assert reply.content == baseline[i % 3]  # byte for byte
    assert (await client.get_status()).restored_pending == 0  # each claimed exactly once

    await client.close()


def test_workers_are_refused_where_they_cannot_apply(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_checkpoint.examples import serve

    for argv, said in (
        (["policy_model", "--workers", "2"], "not policy_model"),
        (["counter", "--workers", "2", "--mcp"], "--mcp does not apply"),
        (["counter", "--workers", "0"], "at least 1"),
    ):
        with pytest.raises(SystemExit) as exited:
            serve.refuse_for_workers(serve.parse_args([*argv, "--token", TOKEN]))
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


def test_a_worker_runs_the_same_command_without_what_only_the_main_process_takes() -> None:
    from rollout_checkpoint.examples.serve import worker_command

    command = worker_command(
        ["counter", "--workers", "3", "--grpc-address=127.0.0.1:9001", "--start-closed", "-v"]
    )
    assert command[1:] == ["-P", "-m", "rollout_checkpoint.examples.serve", "counter", "-v"]
