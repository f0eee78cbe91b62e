"""Turn a NeMo Gym resources server's app into a checkpoint participant.

NeMo Gym's `setup_webserver()` gives a FastAPI app whose middleware (outermost first) is
`SessionMiddleware` (cookie name and secret `f"{ServerClass}___{config.name}"`) then
`add_session_id`, which gives every request a session id under `SESSION_ID_KEY` before routing.
Where each of our layers goes, and the loss a wrong place causes:

- the admission middleware goes right *after* `add_session_id`, inserted into
  `app.user_middleware` (anything `add_middleware` adds lands outside `SessionMiddleware`,
  where no session is decoded yet: every request would look sessionless, nothing would be
  tracked and a checkpoint would export nothing; right after `SessionMiddleware` a new
  session's id is not yet assigned);
- the rollout prefix goes outermost (`add_middleware`): it rewrites `/ng-rollout/<key>/x` to
  `/x` before NeMo Gym routes it. Multi-segment paths escape IPI's catch-all `POST /{tool}`,
  which would answer any single-segment route we added;
- the sidecar and the runtime's own middlewares through `install_checkpointing`, as for our
  own servers.

The cookie stays NeMo Gym's: its secret is derived from the class and instance name, so a
replacement process with the same `config.name` accepts the crashed one's cookies and a
restored session continues under its old id.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Final

from starlette.applications import Starlette
from starlette.middleware import Middleware

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.nemo_gym.hooks import ready_hooks
from rollout_checkpoint.server.resources.middleware import ResourcesAdmissionMiddleware
from rollout_checkpoint.server.resources.participant import (
    CheckpointMode,
    ResourcesParticipant,
    SessionHooks,
    VerifyMode,
)
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

__all__ = ["SESSION_DISPATCH", "NemoGymCheckpointing", "checkpoint_nemo_gym_server"]

SESSION_DISPATCH: Final = "add_session_id"
"""The name of NeMo Gym's `@app.middleware("http")` function that assigns the session id."""
STATELESS_ROUTES: Final = frozenset({"/aggregate_metrics"})
"""NeMo Gym routes that touch no session state: never counted, never refused."""


@dataclass(frozen=True)
class NemoGymCheckpointing:
    """What `checkpoint_nemo_gym_server` installed: the participant and its runtime."""

    participant: ResourcesParticipant
    runtime: CheckpointRuntime


class _NoState:
    """Hooks of a server that exports nothing (`restart_only`, `stateless`): never called
    to export or restore; retiring frees nothing we know of."""

    async def export_session_states(self, session_ids: list[str]) -> dict[str, Any]:
        return {}

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        return None

    async def retire_session_state(self, session_id: str) -> None:
        return None


def checkpoint_nemo_gym_server(
    server: Any,
    app: Starlette,
    settings: CheckpointSettings | None,
    hooks: SessionHooks | None = None,
    *,
    mode: CheckpointMode | None = None,
    verify: VerifyMode | None = None,
    session_key: str | None = None,
    clock: Clock | None = None,
) -> NemoGymCheckpointing | None:
    """Install checkpointing into `app`, the not yet started app of `server.setup_webserver()`.

    Returns None and touches nothing when `settings` is None or not enabled: the server then
    behaves exactly as without us. Otherwise the participant (instance `settings.instance`, else
    `server.config.name`) with the admission middleware inside NeMo Gym's session, the rollout
    prefix outside it, and the sidecar in the app's lifespan.

    `hooks`: the three session hooks over the server's own state; None takes the shipped ones
    for NeMo Gym's IPI and counter servers (`ready_hooks`, which also set `verify`). `mode`:
    `exported` with hooks, else `restart_only` (every live session blocks a checkpoint until
    its rollout is retired: a server nobody audited fails closed). `verify`: `wait` unless
    the shipped hooks say otherwise. `session_key`: where the cookie session holds the id
    (default NeMo Gym's `SESSION_ID_KEY`, imported from nemo_gym.server_utils only then).

    Raises ValueError when `app` has no NeMo Gym session middleware, RuntimeError when it has
    started already (Starlette builds its middleware once), TypeError for mode `exported`
    without hooks, and `MissingExtra` for a configured feature whose extra is missing.
    """
    if settings is None or not settings.enabled:
        return None
    if app.middleware_stack is not None:
        raise RuntimeError("checkpoint_nemo_gym_server: the app has started; call it before")
    index = _session_dispatch_index(app)
    chosen_verify = verify
    if hooks is None:
        shipped = ready_hooks(server)
        if shipped is not None:
            hooks, shipped_verify = shipped
            chosen_verify = verify or shipped_verify
    chosen_mode = mode or (
        CheckpointMode.EXPORTED if hooks is not None else CheckpointMode.RESTART_ONLY
    )
    if chosen_mode is CheckpointMode.EXPORTED and hooks is None:
        raise TypeError(
            f"{type(server).__name__}: checkpoint mode 'exported' needs its three session hooks"
        )
    if session_key is None:
        session_key = str(importlib.import_module("nemo_gym.server_utils").SESSION_ID_KEY)
    participant = ResourcesParticipant(
        str(server.config.name),
        chosen_mode,
        chosen_verify or VerifyMode.WAIT,
        hooks if hooks is not None else _NoState(),
        keep_ended=settings.export_ended_sessions,
    )
    passthrough = set(STATELESS_ROUTES)
    if settings.metrics_path is not None:
        passthrough.add(settings.metrics_path)
    app.user_middleware.insert(
        index + 1,
        Middleware(
            ResourcesAdmissionMiddleware,
            participant=participant,
            passthrough_paths=frozenset(passthrough),
            session_key=session_key,
        ),
    )
    app.add_middleware(RolloutPrefixMiddleware)
    runtime = install_checkpointing(app, participant, settings, clock=clock)
    assert runtime is not None  # settings.enabled
    return NemoGymCheckpointing(participant, runtime)


def _session_dispatch_index(app: Starlette) -> int:
    """The index of NeMo Gym's `add_session_id` entry in `app.user_middleware`."""
    for index, entry in enumerate(app.user_middleware):
        dispatch = entry.kwargs.get("dispatch")
        if getattr(dispatch, "__name__", None) == SESSION_DISPATCH:
            return index
    raise ValueError(
        f"not a NeMo Gym app: no {SESSION_DISPATCH} middleware (pass setup_webserver()'s app)"
    )
