"""Ended sessions kept exportable (`ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS`), for certify's
final-state check: through real HTTP and real RPCs on the counter example, with and without
the setting."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.resources import VerifyMode
from rollout_checkpoint.server.resources.session_table import SessionTable
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import drain
from .test_resources import Running, running


async def verified(r: Running, rollout: str, count: int) -> httpx.AsyncClient:
    """One episode of `rollout`: seeded at `count`, incremented once, verified (it ends)."""
    episode = r.browser()
    prefix = f"/ng-rollout/{rollout}"
    assert (
        await episode.post(f"{prefix}/seed_session", json={"initial_count": count})
    ).status_code == 200
    assert (await episode.post(f"{prefix}/increment_counter", json={"count": 1})).status_code == 200
    reply = await episode.post(f"{prefix}/verify", json={"expected_count": count + 1})
    assert reply.json()["reward"] == 1.0
    return episode


async def committed(
    r: Running, checkpoint_id: str, directory: Path, scope: list[EpisodeId] | None
) -> tuple[list[str], list[Any]]:
    """Prepare (which must not be blocked), commit, resume: the exported capture keys and the
    states written to the part."""
    reports = await drain(r.client.prepare(checkpoint_id, r.deadline()))
    assert [list(m.readiness.blockers) for m in reports] == [[] for _ in reports]
    assert reports[-1].state == types_pb2.PARTICIPANT_STATE_PREPARED
    commit = await r.client.commit(checkpoint_id, r.deadline(), str(directory), scope)
    await r.client.resume(checkpoint_id, r.deadline())
    return list(commit.exported), states_in(directory)


def states_in(directory: Path) -> list[Any]:
    """The part's states in part order, through the runtime's reader: the counter checkpoints
    incrementally, so a later part may reference records of an earlier one."""
    _, records = LocalStorage().read_part(str(directory), "resources", "counter", lambda _: True)
    return [record["state"] for record in records]


async def test_a_verified_session_is_exported_only_by_a_scope_naming_it(tmp_path: Path) -> None:
    async with running(export_ended_sessions=True) as r:
        await verified(r, "r1", 3)
        live = r.browser()
        await live.post("/ng-rollout/r2/seed_session", json={"initial_count": 7})
        assert [e.capture_key for e in await r.client.all_episodes()] == ["r2"]
        assert (await r.client.get_status()).readiness.counts["sessions"] == 1
        named = await committed(r, "c1", tmp_path / "c1", [EpisodeId("r1"), EpisodeId("r2")])
        assert named == (["r1", "r2"], [{"count": 4}, {"count": 7}])
        assert await committed(r, "c2", tmp_path / "c2", None) == (["r2"], [{"count": 7}])
        assert await committed(r, "c3", tmp_path / "c3", [EpisodeId("r2")]) == (
            ["r2"],
            [{"count": 7}],
        )


async def test_retire_frees_an_ended_session_and_forget_keeps_the_later_attempts(
    tmp_path: Path,
) -> None:
    """A collector's rollout that failed once: attempt 0 ended and is retired (its state
    freed), attempt 1 ends, and the rollout is forgotten once attempt 1's reply is durable.
    Attempt 1's ended session is the rollout's final state: a scope naming it still exports
    it (certify's exported-state check reads it after the run)."""
    async with running(export_ended_sessions=True) as r:
        await verified(r, "r1", 3)
        await r.client.retire("x", r.deadline(), [EpisodeId("r1")])
        assert r.server.counters == {}  # the retire hook freed attempt 0's state
        await verified(r, "r1-a1", 5)
        await r.client.forget("x", r.deadline(), ["r1"])
        assert list(r.server.counters.values()) == [6]  # a forget calls no hook
        scope = [EpisodeId("r1"), EpisodeId("r1", 1)]
        assert await committed(r, "c1", tmp_path / "c1", scope) == (["r1-a1"], [{"count": 6}])
        assert (await r.client.get_status()).counters["retired_sessions"] == 0


async def test_a_closed_session_whose_state_is_freed_exports_nothing(tmp_path: Path) -> None:
    async with running(export_ended_sessions=True) as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 1})
        assert (await episode.post("/ng-rollout/r1/close_session")).status_code == 200
        assert r.server.counters == {}  # the default close frees it through the retire hook
        assert await committed(r, "c1", tmp_path / "c1", [EpisodeId("r1")]) == ([], [])


async def test_without_the_setting_an_ended_session_is_not_exported(tmp_path: Path) -> None:
    async with running() as r:
        await verified(r, "r1", 3)
        assert await r.client.all_episodes() == []
        assert await committed(r, "c1", tmp_path / "c1", [EpisodeId("r1")]) == ([], [])
        assert len(r.server.counters) == 1  # held by the server, as it always was


def test_the_setting_is_off_by_default_and_read_from_the_environment(monkeypatch: Any) -> None:
    assert not CheckpointSettings().export_ended_sessions
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS", "true")
    assert CheckpointSettings().export_ended_sessions


def test_the_oldest_ended_session_is_dropped_first_past_the_limit() -> None:
    table = SessionTable(restart_only=False, ended_limit=2)
    episodes = [EpisodeId(f"r{n}") for n in range(3)]
    for n, episode in enumerate(episodes):
        table.track(f"s{n}", episode, seeded_while_closed=False)
        table.end(f"s{n}")
    exported = table.exportable(frozenset(episodes), RetiredAttempts())
    assert [s.session_id for s in exported] == ["s1", "s2"]
    assert table.sessions == {} and table.episodes() == []


class ReplayCounter(CounterServer):
    checkpoint_verify = VerifyMode.REPLAY


async def test_a_verify_during_a_checkpoint_ends_its_session_at_reopen(tmp_path: Path) -> None:
    async with running(ReplayCounter, export_ended_sessions=True) as r:
        episode = r.browser()
        await episode.post("/ng-rollout/r1/seed_session", json={"initial_count": 2})
        await drain(r.client.prepare("c1", r.deadline()))
        reply = await episode.post("/ng-rollout/r1/verify", json={"expected_count": 2})
        assert reply.json()["reward"] == 1.0  # admitted while closed: a replay verify
        commit = await r.client.commit("c1", r.deadline(), str(tmp_path / "c1"))
        assert list(commit.exported) == ["r1"]  # still live until admission reopens
        await r.client.resume("c1", r.deadline())
        assert await r.client.all_episodes() == []
        assert await committed(r, "c2", tmp_path / "c2", None) == ([], [])
        assert await committed(r, "c3", tmp_path / "c3", [EpisodeId("r1")]) == (
            ["r1"],
            [{"count": 2}],
        )


class GatedRetireCounter(CounterServer):
    """Its first retire hook waits for the test: the moment a retire is half way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_retired: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()

    async def retire_session_state(self, session_id: str) -> None:
        if not self.first_retired.done():
            self.first_retired.set_result(session_id)
            await self.release.wait()
        await super().retire_session_state(session_id)


async def test_a_retire_spares_an_ended_session_whose_id_a_seed_made_live_again() -> None:
    async with running(GatedRetireCounter, export_ended_sessions=True) as r:
        server = r.server
        assert isinstance(server, GatedRetireCounter)
        browsers = {count + 1: await verified(r, "r1", count) for count in (1, 2)}
        session_of = {count: sid for sid, count in server.counters.items()}
        retire = asyncio.ensure_future(r.client.retire("x", r.deadline(), [EpisodeId("r1")]))
        first = await asyncio.wait_for(server.first_retired, 30)
        [(count, other)] = [(c, sid) for c, sid in session_of.items() if sid != first]
        reseeded = await browsers[count].post("/ng-rollout/r2/seed_session", json={})
        assert reseeded.status_code == 200  # the same cookie, a new live session of r2
        server.release.set()
        await retire
        assert server.counters == {other: count}  # the live session's state was not freed
        assert [e.capture_key for e in await r.client.all_episodes()] == ["r2"]
