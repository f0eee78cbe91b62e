"""Reading and changing one session's environment (a JSON object) as the tools do.

Every helper is pure in the environment: ids come from counters kept *in* it and times from
its `current_time`, never from randomness or the clock, so a restored session creates exactly
the ids and timestamps the original would have (the byte-for-byte continuation the demo checks).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ToolError

COUNTERS_KEY = "_id_counters"
"""Where an environment keeps the counters its created ids come from."""


def quoted(value: object) -> str:
    """Quote a value inside a message (JSON, so the text stays ASCII and unambiguous)."""
    return json.dumps(value)


def collection_in(env: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = env.get(key)
    if not isinstance(value, kind):
        raise ToolError(f"this environment has no {what}")
    return value


def patients_in(env: dict[str, Any]) -> dict[str, Any]:
    patients: dict[str, Any] = collection_in(env, "patients", dict, "patient records")
    return patients


def patient_in(env: dict[str, Any], patient_id: str) -> dict[str, Any]:
    patient = patients_in(env).get(patient_id.strip())
    if not isinstance(patient, dict):
        raise ToolError(f"no patient with id {quoted(patient_id)}")
    return patient


def candidates_in(env: dict[str, Any]) -> dict[str, Any]:
    candidates: dict[str, Any] = collection_in(env, "candidates", dict, "candidates")
    return candidates


def candidate_in(env: dict[str, Any], candidate_id: str) -> dict[str, Any]:
    candidate = candidates_in(env).get(candidate_id.strip())
    if not isinstance(candidate, dict):
        raise ToolError(f"no candidate with id {quoted(candidate_id)}")
    return candidate


def list_in(env: dict[str, Any], key: str) -> list[Any]:
    """The environment's list under `key`, created (at the end, in order) when missing."""
    value = env.setdefault(key, [])
    if not isinstance(value, list):
        raise ToolError(f"the environment's {key} is not a list")
    return value


def current_user_in(env: dict[str, Any]) -> dict[str, Any]:
    user = env.get("current_user")
    return user if isinstance(user, dict) else {}


def now_in(env: dict[str, Any]) -> str:
    value = env.get("current_time")
    return value if isinstance(value, str) else ""


def new_id_in(env: dict[str, Any], prefix: str, in_use: set[str]) -> str:
    """The next `<prefix>-<n>` id: from a counter kept in the environment, skipping ids taken.

    Pure in the environment: the same environment always yields the same id, so a restored
    session creates exactly the ids the original would have."""
    counters = env.setdefault(COUNTERS_KEY, {})
    if not isinstance(counters, dict):
        raise ToolError(f"the environment's {COUNTERS_KEY} is not an object")
    number = counters.get(prefix, 0)
    if type(number) is not int or number < 0:
        number = 0
    while True:
        number += 1
        candidate = f"{prefix}-{number}"
        if candidate not in in_use:
            counters[prefix] = number
            return candidate


def ids_in(items: list[Any], field: str) -> set[str]:
    return {
        item[field] for item in items if isinstance(item, dict) and isinstance(item.get(field), str)
    }


def matches_filter(value: object, wanted: str | None) -> bool:
    return wanted is None or (
        isinstance(value, str) and value.strip().lower() == wanted.strip().lower()
    )
