"""Session state that is one JSON object per session: schema version 1, exported and restored.

Many resources servers keep each session's tool state as a plain JSON environment (seeded from
the task row, mutated in place by the tools): our prompt-injection example, NeMo Gym's
indirect-prompt-injection server (`session_id_to_env`). `EnvironmentStates` gives such a server
its three session hooks over that dict, with the rules that keep a restore exact:

- export **serializes** each state once (`encode_json`, returned as `EncodedJSON`, stored as
  it is): bytes are independent of the live environment, so the data plane running again
  before the records are written cannot change the cut, and no copy is made only to be
  serialized again; key order kept, because tools print the environment in stored order and
  a restored session must answer byte for byte; anything JSON cannot carry is left to the
  commit's serializer, which refuses it as UNSERIALIZABLE_STATE naming the episode (a raise
  here would only say HOOK_FAILED). The work runs in a thread, a batch of sessions at a time,
  so the event loop serves between batches instead of stalling for the whole export;
- restore validates **every** state before installing any (`InvalidSessionState` naming the
  session): a partial install would leave state that nothing tracks or frees. States a
  Restore decoded from the checkpoint (`DecodedSessionStates`) are plain JSON by construction
  and referenced by nothing else, so only their shape is checked and they are installed as
  they are; any other mapping is walked and copied in full, as a caller's objects may hold
  anything and stay referenced by the caller;
- retire drops the environment, idempotently.

The state is strict: exactly `{"schema_version": 1, "environment": <JSON object>}`, no
coercion (the environment as JSON text is invalid, `true` is not 1), no NaN or Infinity.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

from rollout_checkpoint.server.resources.participant import (
    DecodedSessionStates,
    InvalidSessionState,
)
from rollout_checkpoint.server.runtime.records_codec import EncodedJSON, encode_json

__all__ = [
    "SCHEMA_VERSION",
    "EncodedJSON",
    "EnvironmentStates",
    "encode_json",
    "json_problem",
    "through_json",
    "validate_environment_state",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
EXPORT_BATCH: Final = 256
"""Sessions serialized per thread hop: about a millisecond of work at 5 KB each, so the loop
waits no longer than that, and 10,000 sessions cost 40 hops."""
_STATE_PREFIX: Final = b'{"schema_version":%d,"environment":' % SCHEMA_VERSION


def json_problem(value: object, where: str = "environment") -> str | None:
    """Why `value` is not plain JSON (string keys, finite numbers), or None. No recursion,
    so a deeply nested value cannot overflow the stack."""
    stack: list[tuple[object, str]] = [(value, where)]
    while stack:
        item, at = stack.pop()
        if item is None or isinstance(item, str | bool | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"{at} is {item!r}, which JSON cannot carry"
            continue
        if isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
            continue
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{at} has a key that is not a string: {key!r}"
                stack.append((child, f"{at}.{key}"))
            continue
        return f"{at} is a {type(item).__name__}, not a JSON value"
    return None


def through_json(value: object) -> Any:
    """An independent copy made the way storage writes it: key order kept, and ValueError or
    TypeError (or RecursionError) for anything JSON (as UTF-8 text) cannot carry."""
    text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    return json.loads(text.encode("utf-8"))


def validate_environment_state(
    session_id: str, state: object, *, decoded: bool = False
) -> dict[str, Any]:
    """Check one stored state against schema version 1; return an independent environment.

    Raises `InvalidSessionState` naming the session for anything but exactly
    `{schema_version: 1, environment: <JSON object>}` (see the module docstring). `decoded`:
    the state was just decoded from JSON and nothing else holds it, so its environment is
    plain JSON already and is returned as it is (no walk, no copy)."""

    def invalid(reason: str) -> InvalidSessionState:
        return InvalidSessionState(session_id, f"session {session_id}: {reason}")

    if not isinstance(state, dict):
        raise invalid(f"a state is a JSON object, not {type(state).__name__}")
    if set(state) != {"schema_version", "environment"}:
        extra = sorted(str(k) for k in set(state) - {"schema_version", "environment"})
        missing = sorted({"schema_version", "environment"} - set(state))
        raise invalid(
            "a state holds exactly schema_version and environment"
            + (f" (extra: {', '.join(extra)})" if extra else "")
            + (f" (missing: {', '.join(missing)})" if missing else "")
        )
    version = state["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise invalid(f"schema_version {version!r} is not supported (this server reads 1)")
    environment = state["environment"]
    if not isinstance(environment, dict):
        kind = "JSON text" if isinstance(environment, str) else type(environment).__name__
        raise invalid(f"the environment must be a JSON object, not {kind}")
    if decoded:
        return environment
    problem = json_problem(environment)
    if problem is not None:
        raise invalid(problem)
    try:
        copy: dict[str, Any] = through_json(environment)
    except (ValueError, TypeError, RecursionError) as exc:
        raise invalid(f"the environment cannot be carried as JSON: {exc}") from None
    return copy


class EnvironmentStates:
    """The three session hooks (`SessionHooks`) over `environments`, the server's own live
    `{session_id: environment}` dict (mutated in place, never replaced)."""

    def __init__(self, environments: MutableMapping[str, Any]) -> None:
        self.environments = environments

    async def export_session_states(self, session_ids: list[str]) -> Mapping[str, Any]:
        """`{session_id: EncodedJSON({schema_version: 1, environment: ...})}` for every id
        still held; an id no longer held (verified, closed, retired) is left out.

        The environments are looked up now, on the loop (the cut), and serialized in a
        thread, a batch at a time. Admission is closed, so no tool mutates one meanwhile;
        a replay-safe seed or verify may replace or drop an entry, which leaves the object
        looked up unchanged, and each environment is serialized in one call holding the GIL."""
        held = [
            (session_id, environment)
            for session_id in session_ids
            if (environment := self.environments.get(session_id)) is not None
        ]
        states: dict[str, Any] = {}
        for start in range(0, len(held), EXPORT_BATCH):
            batch = held[start : start + EXPORT_BATCH]
            states.update(await asyncio.to_thread(_encode_states, batch))
        return states

    async def restore_session_states(self, states: dict[str, Any]) -> None:
        """Validate (and, unless decoded by the Restore, copy) every state, then install them
        all; `InvalidSessionState` for the first invalid one, with nothing installed."""
        decoded = isinstance(states, DecodedSessionStates)
        installs = {
            session_id: validate_environment_state(session_id, state, decoded=decoded)
            for session_id, state in states.items()
        }
        self.environments.update(installs)

    async def retire_session_state(self, session_id: str) -> None:
        """Drop the session's environment; nothing for an id not held."""
        self.environments.pop(session_id, None)


def _encode_states(held: list[tuple[str, Any]]) -> dict[str, Any]:
    """Each environment's state serialized (in a thread). One JSON cannot carry stays live,
    for the commit's serializer to refuse naming its episode; admission is closed, so nothing
    mutates it meanwhile."""
    states: dict[str, Any] = {}
    for session_id, environment in held:
        try:
            states[session_id] = EncodedJSON(_STATE_PREFIX + encode_json(environment) + b"}")
        except (ValueError, TypeError, RecursionError) as exc:
            log.warning("session %s holds a value JSON cannot carry: %s", session_id, exc)
            states[session_id] = {"schema_version": SCHEMA_VERSION, "environment": environment}
    return states
