"""Load: hundreds of concurrent tool calls across hundreds of sessions during checkpoints.

The counter example (in-process, served by uvicorn on 127.0.0.1:0) gets hundreds of sessions;
every session makes its calls one after another, all sessions at once, while a checkpoint is
prepared, committed and resumed in a loop. Call `j` of a session adds 4**j, so a counter's
value spells out, digit by digit in base 4, exactly which calls were applied: a digit of 2 is
a call applied twice, a missing digit a call lost. A call refused with 409 `admission_closed`
is not applied and the client retries it.

Every checkpoint taken under load holds, per session, exactly a prefix of its calls: every
call acknowledged before the Prepare was sent, none sent after the Resume returned. The last
checkpoint (after the load) holds every acknowledged call once, and a fresh server restored
from it continues every session from exactly that state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, serve_app
from .loop_thread import only_when_asked_for

SECRET = "a-fixed-session-secret-for-load"
DEADLINE_SECONDS = 60.0
RETRY_SECONDS = 0.2  # a refused call waits this long before it tries again


@dataclass
class Counter:
    server: CounterServer
    base_url: str
    client: ParticipantClient
    runner: uvicorn.Server
    serving: asyncio.Future[None]


async def serve_load_app(app: Any) -> tuple[uvicorn.Server, asyncio.Future[None], int]:
    """Keeps idle connections open for the whole test (with the default 5 s a POST can race
    the server closing its idle connection)."""
    return await serve_app(app, timeout_keep_alive=300, timeout_graceful_shutdown=None)


@contextlib.asynccontextmanager
async def counter() -> AsyncIterator[Counter]:
    config = ResourcesServerConfig(
        instance="counter",
        checkpoint=CheckpointSettings(enabled=True, token=TOKEN),
        session_secret=SECRET,
    )
    server = CounterServer(config)
    runner, serving, port = await serve_load_app(server.build_app())
    assert server.runtime is not None
    client = ParticipantClient(server.runtime.address, TOKEN)
    try:
        yield Counter(server, f"http://127.0.0.1:{port}", client, runner, serving)
    finally:
        await client.close()
        runner.should_exit = True
        await serving


@dataclass
class Session:
    rollout: str
    index: int
    cookie: str = ""
    sent: list[float] = field(default_factory=list)  # per call: when its accepted try was sent
    acked: list[float] = field(default_factory=list)  # per call: when its 200 arrived
    refused: int = 0

    def headers(self) -> dict[str, str]:
        return {"cookie": f"rollout_session={self.cookie}"}


class Clients:
    """Sessions spread over several small connection pools: one pool of hundreds of
    connections makes httpcore spend its time scanning the pool, not sending requests."""

    PER_POOL = 20

    def __init__(self, base_url: str, sessions: int) -> None:
        pools = max(1, -(-sessions // self.PER_POOL))
        limits = httpx.Limits(max_connections=self.PER_POOL + 5)
        self.clients = [
            httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(limits=limits), base_url=base_url, timeout=60
            )
            for _ in range(pools)
        ]

    async def post(self, session: Session, path: str, **kwargs: Any) -> httpx.Response:
        client = self.clients[session.index % len(self.clients)]
        return await client.post(path, **kwargs)

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients:
            await client.aclose()


@dataclass
class Cut:
    """One checkpoint taken under load, as the client saw it."""

    directory: str
    prepare_sent: float
    resume_returned: float
    exported: list[str]


def digits(value: int, calls: int) -> list[int]:
    found = []
    for _ in range(calls + 2):
        found.append(value % 4)
        value //= 4
    assert value == 0
    return found


async def run_load(tmp_path: Path, sessions: int, calls: int, max_cycles: int) -> None:
    everyone = [Session(f"r{i}", i) for i in range(sessions)]
    async with counter() as a, Clients(a.base_url, sessions) as http:

        async def seed(session: Session) -> None:
            response = await http.post(
                session, f"/ng-rollout/{session.rollout}/seed_session", json={"initial_count": 0}
            )
            assert response.status_code == 200, response.text
            session.cookie = response.cookies["rollout_session"]

        await asyncio.gather(*(seed(s) for s in everyone))
        done = asyncio.Event()
        progress = asyncio.Event()
        acked = 0

        async def work(session: Session) -> None:
            nonlocal acked
            for call in range(calls):
                while True:
                    sent = time.monotonic()
                    response = await http.post(
                        session,
                        f"/ng-rollout/{session.rollout}/increment_counter",
                        json={"count": 4**call},
                        headers=session.headers(),
                    )
                    if response.status_code == 200:
                        session.sent.append(sent)
                        session.acked.append(time.monotonic())
                        acked += 1
                        progress.set()
                        break
                    assert response.status_code == 409, response.text
                    assert response.json()["error"]["code"] == "admission_closed"
                    session.refused += 1
                    await asyncio.sleep(RETRY_SECONDS)

        cuts: list[Cut] = []

        async def checkpoints() -> None:
            for cycle in range(max_cycles):
                seen = acked  # let some calls through between two checkpoints
                while acked < seen + sessions // 2 and not done.is_set():
                    progress.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(progress.wait(), 1)
                if done.is_set():
                    return
                checkpoint_id = f"load-{cycle}"
                directory = str(tmp_path / checkpoint_id)
                deadline = time.time() + DEADLINE_SECONDS
                prepare_sent = time.monotonic()
                final = (await drain(a.client.prepare(checkpoint_id, deadline)))[-1]
                assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED, final
                commit = await a.client.commit(checkpoint_id, deadline, directory)
                await a.client.resume(checkpoint_id, deadline)
                cuts.append(Cut(directory, prepare_sent, time.monotonic(), list(commit.exported)))

        checkpointing = asyncio.ensure_future(checkpoints())
        await asyncio.gather(*(work(s) for s in everyone))
        done.set()
        progress.set()
        await checkpointing

        refusals = sum(s.refused for s in everyone)
        print(f"{len(cuts)} checkpoints under load, {refusals} refused calls retried")
        assert len(cuts) >= 2, "the checkpoints did not overlap the load"
        assert refusals > 0, "no call ever met a closed admission: no overlap"
        keys = sorted(s.rollout for s in everyone)
        for cut in cuts:
            assert sorted(cut.exported) == keys
            check_cut(cut, everyone, calls)

        # The last checkpoint, after the load: every acknowledged call, each exactly once.
        final_dir = str(tmp_path / "final")
        deadline = time.time() + DEADLINE_SECONDS
        await drain(a.client.prepare("load-final", deadline))
        await a.client.commit("load-final", deadline, final_dir)
        expected = sum(4**j for j in range(calls))
        assert stored_counts(final_dir) == {s.rollout: expected for s in everyone}

    # A fresh server continues every session from the last checkpoint, and each finishes.
    async with counter() as b, Clients(b.base_url, sessions) as http:
        deadline = time.time() + DEADLINE_SECONDS
        restored = await b.client.restore(
            "restore-1", deadline, final_dir, [EpisodeId(s.rollout) for s in everyone]
        )
        assert sorted(restored.restored) == sorted(f"{s.rollout}-a1" for s in everyone)
        await b.client.resume("restore-1", deadline)

        async def finish(session: Session) -> None:
            prefix = f"/ng-rollout/{session.rollout}-a1"
            step = await http.post(
                session,
                f"{prefix}/increment_counter",
                json={"count": 1},
                headers=session.headers(),
            )
            assert step.status_code == 200, step.text
            verified = await http.post(
                session,
                f"{prefix}/verify",
                json={"expected_count": expected + 1},
                headers=session.headers(),
            )
            # The restored state plus the one new call, each applied once.
            assert verified.json() == {"reward": 1.0, "count": expected + 1}, session.rollout

        await asyncio.gather(*(finish(s) for s in everyone))
        status = await b.client.get_status()
        assert status.readiness.counts["sessions"] == 0  # every continued episode finished


def stored_counts(directory: str) -> dict[str, int]:
    _, records = LocalStorage().read_part(directory, "resources", "counter", lambda _r: True)
    counts = {r["episode_id"]["rollout_id"]: r["state"]["count"] for r in records}
    assert len(counts) == len(records)
    return counts


def check_cut(cut: Cut, everyone: list[Session], calls: int) -> None:
    """The part of a checkpoint taken under load holds, per session, a prefix of its calls:
    each applied once, every call acknowledged before the Prepare, none sent after the Resume."""
    by_rollout = stored_counts(cut.directory)
    assert len(by_rollout) == len(everyone)
    for session in everyone:
        applied = digits(by_rollout[session.rollout], calls)
        assert set(applied) <= {0, 1}, (session.rollout, applied)  # nothing applied twice
        count = applied.index(0)
        assert applied[count:] == [0] * (len(applied) - count), applied  # a prefix: none lost
        for j in range(calls):
            if session.acked[j] < cut.prepare_sent:
                assert applied[j] == 1, (session.rollout, j, "acknowledged before, not in it")
            if session.sent[j] > cut.resume_returned:
                assert applied[j] == 0, (session.rollout, j, "sent after, yet in it")


async def test_hundreds_of_sessions_under_checkpoint_loops_lose_and_duplicate_nothing(
    tmp_path: Path,
) -> None:
    await run_load(tmp_path, sessions=200, calls=3, max_cycles=3)


@pytest.mark.slow
async def test_a_larger_load(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    only_when_asked_for(request)
    await run_load(tmp_path, sessions=500, calls=8, max_cycles=10)
