"""`rollout_checkpoint.server.nemo_gym`, in-process, on an app shaped like NeMo Gym's.

nemo-gym needs Python 3.12 (this suite runs on 3.11), so the app here is built the way
`SimpleResourcesServer.setup_webserver()` builds it (tests/nemo_gym/FACTS.md): an
`@app.middleware("http") add_session_id` that assigns `session["session_id"]` on every
request, then Starlette's `SessionMiddleware` added outside it, and a counter server's routes
over `session_id_to_counter`. What is checked: where our layers land, that sessions are
tracked per episode under NeMo Gym's key through the rollout prefix, the shipped hooks'
strictness, and that checkpointing off changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from starlette.middleware.sessions import SessionMiddleware

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.nemo_gym import (
    CounterStates,
    checkpoint_nemo_gym_server,
    ready_hooks,
)
from rollout_checkpoint.server.resources import InvalidSessionState, VerifyMode
from rollout_checkpoint.server.resources.json_state import EnvironmentStates
from rollout_checkpoint.server.resources.middleware import ResourcesAdmissionMiddleware
from rollout_checkpoint.server.resources.participant import CheckpointMode
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, rollout_path
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, serve_app

SESSION_ID_KEY = "session_id"  # nemo_gym.server_utils.SESSION_ID_KEY (FACTS.md)


class _Config:
    name = "example_session_state_mgmt_resources_server"


class StatefulCounterResourcesServer:
    """The shape of NeMo Gym's counter server: its state dict and `setup_webserver()`."""

    def __init__(self) -> None:
        self.config = _Config()
        self.session_id_to_counter: dict[str, int] = {}

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()
        key = f"{type(self).__name__}___{self.config.name}"

        @app.middleware("http")
        async def add_session_id(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            request.session[SESSION_ID_KEY] = str(
                request.session.get(SESSION_ID_KEY) or uuid.uuid4()
            )
            return await call_next(request)

        app.add_middleware(SessionMiddleware, secret_key=key, session_cookie=key)

        @app.post("/seed_session")
        async def seed(request: Request) -> dict[str, Any]:
            body = await request.json()
            sid = request.session[SESSION_ID_KEY]
            self.session_id_to_counter.setdefault(sid, body.get("initial_count", 0))
            return {}

        @app.post("/increment_counter")
        async def increment(request: Request) -> dict[str, Any]:
            body = await request.json()
            sid = request.session[SESSION_ID_KEY]
            self.session_id_to_counter[sid] = (
                self.session_id_to_counter.setdefault(sid, 0) + body["count"]
            )
            return {"success": True}

        return app


def settings() -> CheckpointSettings:
    return CheckpointSettings(enabled=True, token=TOKEN)


def test_layers_land_inside_and_outside_nemo_gyms_session() -> None:
    server = StatefulCounterResourcesServer()
    app = server.setup_webserver()
    installed = checkpoint_nemo_gym_server(server, app, settings(), session_key=SESSION_ID_KEY)
    assert installed is not None
    assert installed.participant.mode is CheckpointMode.EXPORTED
    assert installed.participant.verify is VerifyMode.REPLAY  # the counter's verify only reads
    assert installed.participant.instance == _Config.name
    classes = [entry.cls for entry in app.user_middleware]
    session = classes.index(SessionMiddleware)
    admission = classes.index(ResourcesAdmissionMiddleware)
    add_session_id = admission - 1
    assert app.user_middleware[add_session_id].kwargs["dispatch"].__name__ == "add_session_id"
    assert session < add_session_id < admission
    assert classes.index(RolloutPrefixMiddleware) < session


def test_checkpointing_off_touches_nothing() -> None:
    server = StatefulCounterResourcesServer()
    app = server.setup_webserver()
    before = list(app.user_middleware)
    assert checkpoint_nemo_gym_server(server, app, None) is None
    assert checkpoint_nemo_gym_server(server, app, CheckpointSettings()) is None
    assert app.user_middleware == before


def test_refusals() -> None:
    server = StatefulCounterResourcesServer()
    with pytest.raises(ValueError, match="not a NeMo Gym app"):
        checkpoint_nemo_gym_server(server, FastAPI(), settings(), session_key=SESSION_ID_KEY)

    class OwnServer(StatefulCounterResourcesServer):
        pass

    with pytest.raises(TypeError, match="needs its three session hooks"):
        checkpoint_nemo_gym_server(
            OwnServer(),
            OwnServer().setup_webserver(),
            settings(),
            mode=CheckpointMode.EXPORTED,
            session_key=SESSION_ID_KEY,
        )
    # Without hooks a server nobody audited fails closed.
    own = OwnServer()
    installed = checkpoint_nemo_gym_server(
        own, own.setup_webserver(), settings(), session_key=SESSION_ID_KEY
    )
    assert installed is not None and installed.participant.mode is CheckpointMode.RESTART_ONLY


async def test_an_episode_is_tracked_under_nemo_gyms_session_id() -> None:
    server = StatefulCounterResourcesServer()
    app = server.setup_webserver()
    installed = checkpoint_nemo_gym_server(server, app, settings(), session_key=SESSION_ID_KEY)
    assert installed is not None
    episode = EpisodeId("r1")
    uvicorn_server, serving, port = await serve_app(app)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            seeded = await http.post(
                rollout_path(episode, "/seed_session"), json={"initial_count": 3}
            )
            assert seeded.status_code == 200, seeded.text
            assert seeded.headers["x-ng-checkpoint-verify"] == "replay"
            added = await http.post(rollout_path(episode, "/increment_counter"), json={"count": 2})
            assert added.json() == {"success": True}
        [(session_id, count)] = server.session_id_to_counter.items()
        assert count == 5
        assert installed.participant.sessions[session_id].episode == episode
        hooks = ready_hooks(server)
        assert hooks is not None
        exported = await hooks[0].export_session_states([session_id, "gone"])
        assert exported == {session_id: {"schema_version": 1, "count": 5}}
    finally:
        uvicorn_server.should_exit = True
        await serving


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"schema_version": 1},
        {"schema_version": 1, "count": True},
        {"schema_version": 1, "count": "5"},
        {"schema_version": 2, "count": 5},
        {"schema_version": 1, "count": 5, "extra": 0},
    ],
)
async def test_counter_restore_is_strict_and_all_or_nothing(bad: object) -> None:
    counters: dict[str, int] = {}
    hooks = CounterStates(counters)
    with pytest.raises(InvalidSessionState) as raised:
        await hooks.restore_session_states({"ok": {"schema_version": 1, "count": 1}, "bad": bad})
    assert raised.value.session_id == "bad"
    assert counters == {}
    await hooks.restore_session_states({"ok": {"schema_version": 1, "count": 1}})
    assert counters == {"ok": 1}
    await hooks.retire_session_state("ok")
    await hooks.retire_session_state("ok")
    assert counters == {}


def test_ipi_gets_environment_states_and_waits_for_verify() -> None:
    class IPIResourcesServer:
        def __init__(self) -> None:
            self.session_id_to_env: dict[str, Any] = {}

    server = IPIResourcesServer()
    shipped = ready_hooks(server)
    assert shipped is not None
    hooks, verify = shipped
    assert isinstance(hooks, EnvironmentStates) and verify is VerifyMode.WAIT
    assert hooks.environments is server.session_id_to_env
    assert ready_hooks(object()) is None


async def test_the_export_ended_sessions_setting_reaches_a_nemo_gym_server() -> None:
    """Certify starts `serve nemo-gym:…` with ROLLOUT_CHECKPOINT_EXPORT_ENDED_SESSIONS=true: a
    session its verify ended is exported by a scope naming its episode (never unscoped)."""
    server = StatefulCounterResourcesServer()
    app = server.setup_webserver()

    @app.post("/verify")
    async def verify() -> dict[str, Any]:
        return {"reward": 1.0}

    kept = CheckpointSettings(enabled=True, token=TOKEN, export_ended_sessions=True)
    installed = checkpoint_nemo_gym_server(server, app, kept, session_key=SESSION_ID_KEY)
    assert installed is not None
    episode = EpisodeId("r1")
    uvicorn_server, serving, port = await serve_app(app)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            await http.post(rollout_path(episode, "/seed_session"), json={"initial_count": 3})
            await http.post(rollout_path(episode, "/increment_counter"), json={"count": 2})
            assert (await http.post(rollout_path(episode, "/verify"), json={})).status_code == 200
        assert installed.participant.sessions == {}
        assert await installed.participant.export(None) == []
        [record] = await installed.participant.export(frozenset({episode}))
        assert record.episode_id == episode and record.fields["state"]["count"] == 5
    finally:
        uvicorn_server.should_exit = True
        await serving
