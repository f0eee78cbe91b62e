"""A fresh process stays fit to restore until it tracks something, and a restore can be undone.

Per participant kind (resources, model, agent, environment), real servers on 127.0.0.1:0:

* "served" means tracked a session or an episode through the data plane: a request refused
  or failed before any existed (400, 404, 409, a seed without a prefix, a model call without
  one) leaves the process fresh, so its Restore still works; anything tracked, even once,
  makes it unfit (FRESH_PROCESS_REQUIRED).
* `discard_installed` undoes an install exactly: what it installed is freed (resources:
  through the server's retire hook), no retired mark is left, the process is fresh again and
  the same install works a second time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.agent import AgentConfig, AgentServer
from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.examples.environment import EnvironmentConfig, EnvironmentServer
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.episodic.episode_participant import task_digest
from rollout_checkpoint.server.runtime.participant import Participant, RestoredRecord
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, drain, refused, serve_app
from .test_policy_model import CLINIC, chat, model
from .test_resources import Running, prepared, running

RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED
R, S = EpisodeId("r"), EpisodeId("s", 2)


def code_of(reply: httpx.Response) -> str | None:
    try:
        error = reply.json().get("error")
    except ValueError:
        return None
    return error.get("code") if isinstance(error, dict) else None


# -- resources ------------------------------------------------------------------------------


class RecordingCounter(CounterServer):
    """Records every call of its retire hook."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retired_states: list[str] = []

    async def retire_session_state(self, session_id: str) -> None:
        self.retired_states.append(session_id)
        await super().retire_session_state(session_id)


async def counter_checkpoint(path: str) -> dict[str, tuple[EpisodeId, httpx.Cookies, int]]:
    """Commit two sessions of r and one of s-a2; their ids, episodes, cookies and counts."""
    sessions: dict[str, tuple[EpisodeId, httpx.Cookies, int]] = {}
    async with running() as a:
        for episode, initial in ((R, 3), (R, 4), (S, 5)):
            jar = a.browser()
            await jar.post(f"/ng-rollout/{episode.capture_key}/seed_session", json={})
            await jar.post(
                f"/ng-rollout/{episode.capture_key}/increment_counter", json={"count": initial}
            )
            (session_id,) = set(a.participant.sessions) - set(sessions)
            sessions[session_id] = (episode, jar.cookies, initial)
        await prepared(a)
        await a.client.commit("c1", a.deadline(), path)
    return sessions


async def stray_requests(r: Running) -> None:
    """Requests that track nothing, each answered before any session or episode exists."""
    jar = r.browser()
    replies = [
        await jar.post("/increment_counter", json={"count": 1}),
        await jar.post("/ng-rollout/r/increment_counter", json={"count": 1}),
        await jar.post("/ng-rollout/r/verify", json={}),
        await jar.post("/ng-rollout/r/close_session"),
        await jar.post("/no/such/route", json={}),
        await jar.post("/ng-rollout/-bad/seed_session", json={}),
    ]
    assert [reply.status_code for reply in replies] == [400, 400, 400, 400, 404, 400]
    # A seed without a prefix: the server holds state, but no episode tracks it.
    assert (await jar.post("/seed_session", json={})).status_code == 200
    assert (await jar.post("/increment_counter", json={"count": 2})).status_code == 200
    # A refusal: the prefix names a retired attempt.
    await r.client.retire("x", r.deadline(), [EpisodeId("old")])
    stale = await r.browser().post("/ng-rollout/old/seed_session", json={})
    assert stale.status_code == 409 and code_of(stale) == "stale_attempt"


async def test_stray_requests_leave_a_resources_process_fit_to_restore(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    sessions = await counter_checkpoint(checkpoint)
    async with running() as b:
        await stray_requests(b)
        assert not b.participant.has_served()
        reply = await b.client.restore("restore-1", b.deadline(), checkpoint, [R, S])
        assert reply.state == RESTORED and set(reply.restored) == {"r-a1", "s-a3"}
        await b.client.resume("restore-1", b.deadline())
        for episode, cookies, expected in sessions.values():
            jar = b.browser(cookies)
            key = episode.next_attempt().capture_key
            got = await jar.post(f"/ng-rollout/{key}/get_counter_value", json={})
            assert got.json() == {"count": expected}


async def test_a_failed_seed_under_a_prefix_tracks_nothing(tmp_path: Path) -> None:
    async with running(PromptInjectionServer, instance="prompt_injection") as a:
        await prepared(a)
        await a.client.commit("c1", a.deadline(), str(tmp_path / "ckpt"))
    async with running(PromptInjectionServer, instance="prompt_injection") as b:
        failed = await b.browser().post("/ng-rollout/r/seed_session", json={"environment": 1})
        assert failed.status_code == 400 and code_of(failed) == "invalid_environment"
        assert not b.participant.has_served()
        reply = await b.client.restore("restore-1", b.deadline(), str(tmp_path / "ckpt"), [R])
        assert reply.state == RESTORED


async def test_a_session_once_tracked_makes_the_process_unfit_even_after_it_closed(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    await counter_checkpoint(checkpoint)
    async with running() as b:
        jar = b.browser()
        await jar.post("/ng-rollout/q/seed_session", json={})
        assert (await jar.post("/ng-rollout/q/close_session")).status_code == 200
        assert not b.participant.sessions and b.participant.has_served()
        await refused(
            b.client.restore("restore-1", b.deadline(), checkpoint, [R]),
            "FRESH_PROCESS_REQUIRED",
            "FAILED_PRECONDITION",
        )


async def test_discard_installed_frees_resources_sessions_without_marks(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    sessions = await counter_checkpoint(checkpoint)
    async with running(RecordingCounter) as b:
        server = b.server
        assert isinstance(server, RecordingCounter)
        participant = b.participant
        await b.client.restore("restore-1", b.deadline(), checkpoint, [R, S])
        marks = {rollout: participant.context.retired.highest(rollout) for rollout in "rs"}
        of_r = {sid for sid, (episode, _, _) in sessions.items() if episode == R}

        await participant.discard_installed([R.next_attempt()])
        assert sorted(server.retired_states) == sorted(of_r)
        assert set(server.counters) == set(sessions) - of_r
        assert {s.episode for s in participant.sessions.values()} == {S.next_attempt()}
        assert participant.has_served()  # s-a3 is still installed

        await participant.discard_installed([R.next_attempt(), S.next_attempt(), EpisodeId("z")])
        await participant.discard_installed([S.next_attempt()])  # a repeat frees nothing more
        assert sorted(server.retired_states) == sorted(sessions)
        assert server.counters == {} and not participant.sessions
        assert not participant.retired_sessions
        assert {r: participant.context.retired.highest(r) for r in "rs"} == marks
        assert participant.restored_pending() == frozenset() and not participant.episodes()
        assert not participant.has_served()

        # The same install works again, and its sessions answer the old cookies.
        records = [
            RestoredRecord(episode, {"session_id": sid, "state": {"count": count}})
            for sid, (episode, _, count) in sessions.items()
        ]
        await participant.install(records)
        assert participant.has_served()
        await b.client.resume("restore-1", b.deadline())
        for episode, cookies, expected in sessions.values():
            key = episode.next_attempt().capture_key
            got = await b.browser(cookies).post(f"/ng-rollout/{key}/get_counter_value", json={})
            assert got.json() == {"count": expected}


async def test_a_restored_session_retired_here_keeps_the_process_unfit(tmp_path: Path) -> None:
    """Undoing an install is `discard_installed`, not a retire: a retire leaves marks."""
    checkpoint = str(tmp_path / "ckpt")
    await counter_checkpoint(checkpoint)
    async with running() as b:
        await b.client.restore("restore-1", b.deadline(), checkpoint, [R])
        await b.client.resume("restore-1", b.deadline())
        await b.client.retire("x", b.deadline(), [R.next_attempt()])
        assert not b.participant.sessions and b.participant.retired_sessions
        assert b.participant.has_served()


# -- model ----------------------------------------------------------------------------------


async def model_checkpoint(path: str) -> None:
    async with model() as a:
        assert (await a.post("r", chat(CLINIC))).status_code == 200
        await a.prepared("c1")
        await a.client.commit("c1", a.deadline(), path, [R])


async def test_a_model_call_without_an_episode_leaves_the_process_fit_to_restore(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    await model_checkpoint(checkpoint)
    async with model() as b:
        assert (await b.post(None, chat(CLINIC))).status_code == 200
        assert (await b.http.post("/v1/no-such-route", json={})).status_code == 404
        assert not b.participant.has_served()
        reply = await b.client.restore("restore-1", b.deadline(), checkpoint, [R])
        assert reply.state == RESTORED and list(reply.restored) == ["r-a1"]
    async with model() as c:
        assert (await c.post("q", chat(CLINIC))).status_code == 200  # an episode: served
        await refused(
            c.client.restore("restore-1", c.deadline(), checkpoint, [R]),
            "FRESH_PROCESS_REQUIRED",
        )


async def test_discard_installed_drops_model_ledgers_without_marks(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    await model_checkpoint(checkpoint)
    async with model() as b:
        participant = b.participant
        await b.client.restore("restore-1", b.deadline(), checkpoint, [R])
        ledger = participant.restored[R.next_attempt()].calls
        marks = participant.context.retired.highest("r")
        assert participant.has_served()
        await participant.discard_installed([R.next_attempt()])
        await participant.discard_installed([R.next_attempt()])
        assert not participant.restored and not participant.ledgers
        assert participant.context.retired.highest("r") == marks
        assert not participant.has_served() and not participant.episodes()
        await participant.install([RestoredRecord(R, {"calls": ledger})])
        assert participant.restored_pending() == {R.next_attempt()}


# -- agent and environment ------------------------------------------------------------------


@dataclass
class EpisodeServer:
    server: Any
    http: httpx.AsyncClient
    client: ParticipantClient

    @property
    def participant(self) -> Participant:
        participant: Participant = self.server.participant
        return participant


DEAD = "http://127.0.0.1:1"
"""Nothing listens here: an episode that begins fails at its first upstream call."""


@contextlib.asynccontextmanager
async def episode_server(kind: str) -> AsyncIterator[EpisodeServer]:
    settings = CheckpointSettings(enabled=True, token=TOKEN)
    server: Any = (
        AgentServer(
            AgentConfig(
                model_url=DEAD, servers={"pi": DEAD}, checkpoint=settings, unreachable_seconds=0.2
            )
        )
        if kind == "agent"
        else EnvironmentServer(
            EnvironmentConfig(agent_url=DEAD, checkpoint=settings, unreachable_seconds=0.2)
        )
    )
    runner, serving, port = await serve_app(server.build_app())
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
    client = ParticipantClient(server.runtime.address, TOKEN)
    try:
        yield EpisodeServer(server, http, client)
    finally:
        await http.aclose()
        await client.close()
        runner.should_exit = True
        await serving


def deadline(seconds: float = 30.0) -> float:
    return time.time() + seconds


TASK = {"task_id": "t1", "environment": {}}


async def empty_checkpoint(kind: str, path: str) -> None:
    async with episode_server(kind) as a:
        await drain(a.client.prepare("c1", deadline()))
        await a.client.commit("c1", deadline(), path)


async def test_refused_runs_leave_agent_and_environment_processes_fit_to_restore(
    tmp_path: Path,
) -> None:
    for kind in ("agent", "environment"):
        checkpoint = str(tmp_path / kind)
        await empty_checkpoint(kind, checkpoint)
        async with episode_server(kind) as b:
            no_prefix = await b.http.post("/run", json={"task": TASK, "resources_server": "pi"})
            assert code_of(no_prefix) == "rollout_id_required"
            no_task = await b.http.post("/ng-rollout/r/run", json={})
            assert code_of(no_task) == "invalid_task"
            assert (await b.http.post("/ng-rollout/r/nothing", json={})).status_code == 404
            await b.client.retire("x", deadline(), [EpisodeId("old")])
            stale = await b.http.post(
                "/ng-rollout/old/run", json={"task": TASK, "resources_server": "pi"}
            )
            assert code_of(stale) == "stale_attempt"
            assert not b.participant.has_served(), kind
            reply = await b.client.restore("restore-1", deadline(), checkpoint, [R])
            assert reply.state == RESTORED, kind


async def test_an_episode_that_began_and_failed_still_makes_the_process_unfit(
    tmp_path: Path,
) -> None:
    for kind in ("agent", "environment"):
        checkpoint = str(tmp_path / kind)
        await empty_checkpoint(kind, checkpoint)
        async with episode_server(kind) as b:
            failed = await b.http.post(
                "/ng-rollout/q/run", json={"task": TASK, "resources_server": "pi"}
            )
            assert failed.status_code >= 500 or code_of(failed) == "upstream_failed", failed.text
            assert not b.participant.episodes()  # it ended and left nothing behind
            assert b.participant.has_served(), kind
            await refused(
                b.client.restore("restore-1", deadline(), checkpoint, [R]),
                "FRESH_PROCESS_REQUIRED",
            )


def episode_records(kind: str) -> list[RestoredRecord]:
    boundary = {"next": "relay"}
    if kind == "agent":
        return [RestoredRecord(R, {"boundary": boundary}), RestoredRecord(S, {"boundary": None})]
    digest = task_digest(TASK)
    return [
        RestoredRecord(R, {"task_digest": digest, "boundary": boundary}),
        RestoredRecord(S, {"task_digest": digest, "boundary": None}),
    ]


async def test_discard_installed_drops_restored_boundaries_without_marks() -> None:
    for kind in ("agent", "environment"):
        async with episode_server(kind) as b:
            participant = b.participant
            await participant.install(episode_records(kind))
            assert participant.restored_pending() == {R.next_attempt(), S.next_attempt()}
            marks = participant.context.retired.highest("r")
            await participant.discard_installed([R.next_attempt()])
            assert participant.restored_pending() == {S.next_attempt()}
            await participant.discard_installed([R.next_attempt(), S.next_attempt()])
            await participant.discard_installed([S.next_attempt()])
            assert participant.restored_pending() == frozenset() and not participant.episodes()
            assert participant.context.retired.highest("r") == marks
            assert not participant.has_served(), kind
            await participant.install(episode_records(kind))
            assert participant.restored_pending() == {R.next_attempt(), S.next_attempt()}


async def test_a_failed_environment_install_pins_no_task() -> None:
    """A restored episode pins its task; an install that failed installed nothing to pin."""
    other = {"task_id": "t2", "environment": {"x": 1}}
    async with episode_server("environment") as b:
        invalid = RestoredRecord(S, {"task_digest": "short", "boundary": None})
        with pytest.raises(CheckpointError):
            await b.participant.install([episode_records("environment")[0], invalid])
        assert not b.participant.has_served()
        started = await b.http.post("/ng-rollout/r-a1/run", json={"task": other})
        assert code_of(started) != "task_mismatch", started.text


async def test_a_discarded_environment_install_pins_no_task() -> None:
    other = {"task_id": "t2", "environment": {"x": 1}}
    async with episode_server("environment") as b:
        await b.participant.install(episode_records("environment"))
        await b.participant.discard_installed([R.next_attempt(), S.next_attempt()])
        started = await b.http.post("/ng-rollout/r-a1/run", json={"task": other})
        assert code_of(started) != "task_mismatch", started.text
