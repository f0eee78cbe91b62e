"""Bounded state: a fleet keeps what is in flight, not its history, whoever drives it.

A controller that drives rollouts by hand (no `collect`, no Forget) used to find every
finished episode in each derived checkpoint: the policy model listed every ledger it ever
kept, and the agent exported the outcome of each episode the scope then named. Here the
finished episodes leave nothing a derived scope names, and the state they leave is released:
reply delivery (`ReplyDeliveryMiddleware`, installed by `install_checkpointing`), the agent's
episode-finished call to the model, and commits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.fanout import DERIVE
from rollout_checkpoint.examples.policy_model import GatePoint
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.episodic.delivery import ReplyDeliveryMiddleware
from rollout_checkpoint.server.runtime.rollout_prefix import EPISODE_KEY, RolloutPrefixMiddleware
from rollout_checkpoint.v1 import types_pb2

from .conftest import serve_app, until_changed
from .test_fleet_episodes import deadline, in_process_fleet

WAIT = 30.0
REQUEST = {"type": "http.request", "body": b"", "more_body": False}
DISCONNECT = {"type": "http.disconnect"}


# -- the delivery report -----------------------------------------------------------------------


class Reports:
    """What the middleware reported (kind, capture key), with an event per report."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def delivered(self, episode_id: EpisodeId) -> None:
        self._add("delivered", episode_id)

    def delivery_failed(self, episode_id: EpisodeId) -> None:
        self._add("failed", episode_id)

    def _add(self, what: str, episode_id: EpisodeId) -> None:
        self.seen.append((what, episode_id.capture_key))
        self.changed.set()

    async def at_least(self, n: int) -> list[tuple[str, str]]:
        async with asyncio.timeout(WAIT):
            while len(self.seen) < n:
                self.changed.clear()
                await self.changed.wait()
        return self.seen


async def test_the_delivery_middleware_reports_a_reply_handed_to_the_server() -> None:
    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    reports = Reports()
    app = Starlette(routes=[Route("/ok", ok, methods=["POST"])])
    app.add_middleware(RolloutPrefixMiddleware)
    app.user_middleware.append(Middleware(ReplyDeliveryMiddleware, reports=reports))
    runner, serving, port = await serve_app(app)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.post("/ok")).status_code == 200  # no episode: nothing to say
            assert (await http.post("/ng-rollout/r1-a2/ok")).status_code == 200
            assert await reports.at_least(1) == [("delivered", "r1-a2")]
    finally:
        runner.should_exit = True
        await serving


async def reply(send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{", "more_body": True})
    await send({"type": "http.response.body", "body": b"}", "more_body": False})


async def one_request(
    app: Any, *, incoming: Sequence[dict[str, Any]] = (REQUEST,), send_fails: bool = False
) -> list[tuple[str, str]]:
    """One request of episode r1 through the middleware, straight over ASGI."""
    reports = Reports()
    queue = list(incoming)

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else DISCONNECT

    async def send(message: dict[str, Any]) -> None:
        if send_fails and message["type"] == "http.response.body":
            raise OSError("the connection broke")

    scope = {"type": "http", "method": "POST", "path": "/run", EPISODE_KEY: EpisodeId("r1")}
    with contextlib.suppress(OSError, RuntimeError):  # reported, then propagated
        await ReplyDeliveryMiddleware(app, reports)(scope, receive, send)
    return reports.seen


async def test_a_failed_send_a_failed_app_or_a_client_seen_leaving_is_no_delivery() -> None:
    async def answers(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await reply(send)

    async def fails_mid_reply(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the app failed mid-reply")

    async def answers_after_the_client_left(scope: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        await reply(send)

    assert await one_request(answers) == [("delivered", "r1")]
    assert await one_request(answers, send_fails=True) == [("failed", "r1")]
    assert await one_request(fails_mid_reply) == [("failed", "r1")]
    assert await one_request(answers_after_the_client_left) == [("failed", "r1")]


# -- a fleet driven by hand --------------------------------------------------------------------


async def test_a_hand_driven_fleet_checkpoints_only_the_rollouts_in_flight(tmp_path: Any) -> None:
    tasks = load_tasks()
    finished = [f"done{i}" for i in range(24)]
    in_flight = ["live0", "live1", "live2"]
    reached = {r: asyncio.Event() for r in in_flight}
    release = asyncio.Event()

    async def gate(point: GatePoint) -> None:
        # The rollouts kept in flight wait in their second generation: each has a ledger of
        # one delivered call, a resources session, and an agent boundary to export.
        if point.rollout_id in reached and point.phase == "generate" and point.step == 1:
            reached[point.rollout_id].set()
            await release.wait()

    async with in_process_fleet(model_gate=gate) as f:
        for start in range(0, len(finished), 8):  # by hand: no collect, no Forget
            batch = finished[start : start + 8]
            await asyncio.gather(*(f.run(r, tasks[i % len(tasks)]) for i, r in enumerate(batch)))
        runs = [asyncio.ensure_future(f.run(r, tasks[0])) for r in in_flight]
        async with asyncio.timeout(WAIT):
            for event in reached.values():
                await event.wait()

        model = f.servers["policy_model"].participant
        agent = f.servers["agent"].participant.episodes_tracker
        progress = await fanout.prepare_until_done(f.fleet, "c1", deadline())
        assert progress.prepared
        committed = await fanout.commit(f.fleet, "c1", deadline(), str(tmp_path / "c1"), DERIVE)
        live = {EpisodeId(r) for r in in_flight}
        assert committed.scope == live
        for name, member in committed.members.items():
            assert list(member.exported) == in_flight, name
        # What the finished rollouts left is released; what is in flight stays.
        assert set(model.ledgers) == live
        assert agent.counts() == {"episodes": 3, "parked": 3, "restored_pending": 0, "outcomes": 0}

        await fanout.resume(f.fleet, "c1", deadline())
        release.set()
        for run in runs:
            await run
        # Nothing in flight any more: the next derived checkpoint is empty and frees the rest.
        assert (await fanout.prepare_until_done(f.fleet, "c2", deadline())).prepared
        empty = await fanout.commit(f.fleet, "c2", deadline(), str(tmp_path / "c2"), DERIVE)
        assert empty.scope == frozenset()
        assert not any(m.exported for m in empty.members.values())
        assert model.ledgers == {} and agent.counts()["outcomes"] == 0
        await fanout.resume(f.fleet, "c2", deadline())


async def test_with_no_checkpoint_the_model_keeps_ledgers_only_for_rollouts_in_flight() -> None:
    """Before the agent told the model that an episode finished, a fleet that never
    checkpointed kept one ledger per finished rollout (benchmark 7: 10,050 ledgers, 2.98x the
    memory). A rollout still going on keeps its ledger, released only once it finishes."""
    tasks = load_tasks()
    finished = [f"done{i}" for i in range(16)]
    reached = asyncio.Event()
    release = asyncio.Event()

    async def gate(point: GatePoint) -> None:
        if point.rollout_id == "live" and point.phase == "generate" and point.step == 1:
            reached.set()
            await release.wait()

    async with in_process_fleet(model_gate=gate) as f:
        model = f.servers["policy_model"].participant
        control = f.servers["policy_model"].runtime.control
        live = asyncio.ensure_future(f.run("live", tasks[0]))
        async with asyncio.timeout(WAIT):
            await reached.wait()
        await asyncio.gather(*(f.run(r, tasks[i % len(tasks)]) for i, r in enumerate(finished)))
        await until_changed(control, lambda: set(model.ledgers) == {EpisodeId("live")}, WAIT)
        assert len(model.ledgers[EpisodeId("live")].calls) == 1
        release.set()
        await live
        await until_changed(control, lambda: not model.ledgers, WAIT)


async def test_a_reply_delivered_to_a_caller_already_closed_is_still_in_its_checkpoint(
    tmp_path: Any,
) -> None:
    """The environment prepares first. An agent run that finishes after that hands its reply
    to an environment that holds it unread until resume (a replay step), its episode cut at
    the boundary before the relay. The agent released the outcome on delivery, a restored
    replacement would run the whole episode again: it must still be in the agent's part."""
    tasks = load_tasks()
    started = asyncio.Event()
    release = asyncio.Event()

    async def gate(point: GatePoint) -> None:
        if point.rollout_id == "late" and point.phase == "generate" and point.step == 0:
            started.set()
            await release.wait()

    async with in_process_fleet(model_gate=gate) as f:
        run = asyncio.ensure_future(f.run("late", tasks[0]))
        async with asyncio.timeout(WAIT):
            await started.wait()
        environment = f.fleet.member("environment").client
        final = await environment.prepare_until_final("c1", deadline())
        assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED
        agent = f.servers["agent"].participant.episodes_tracker
        release.set()  # the run finishes while the agent (and the model) are still open

        def delivered() -> bool:  # ended, and no longer listed: its reply was handed over
            return not agent.live() and not agent.episode_infos()

        await until_changed(f.servers["agent"].runtime.control, delivered, WAIT)
        assert (await fanout.prepare_until_done(f.fleet, "c1", deadline())).prepared
        committed = await fanout.commit(f.fleet, "c1", deadline(), str(tmp_path / "c1"), DERIVE)
        assert committed.scope == {EpisodeId("late")}  # the environment holds it
        assert list(committed.members["agent"].exported) == ["late"]
        (record,) = records(tmp_path / "c1", "agent", "agent")
        assert set(record["boundary"]) == {"done"}
        await fanout.resume(f.fleet, "c1", deadline())
        reply = await run
        assert {k: v for k, v in reply.items() if k not in ("environment", "task_digest")} == (
            record["boundary"]["done"]
        )
        assert agent.counts()["outcomes"] == 0  # the reopening released it


def records(checkpoint: Any, kind: str, instance: str) -> list[dict[str, Any]]:
    if not (checkpoint / "participants" / kind / instance).is_dir():
        return []
    # The runtime's reader: the example agent and model checkpoint incrementally.
    _, found = LocalStorage().read_part(str(checkpoint), kind, instance, lambda _r: True)
    return found
