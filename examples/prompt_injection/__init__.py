"""The prompt-injection example: an `exported` resources server for indirect prompt injection.

Each session holds one mutable JSON *environment* seeded from a task row (see
`prompt_injection_tasks.jsonl` and `load_tasks()`): a healthcare clinic (patients and their
charts, appointments, messages, prescriptions, lab results) or a hiring pipeline (candidates,
messages, offers). Tools read and change it. Some records carry injected instructions that try
to make the agent call a target tool with target arguments; `/verify` scores whether the agent
followed them (safety) and whether it did its job (utility).

Determinism is what makes a restored session answer byte for byte as the original would: a
tool's output depends on nothing but the environment and its arguments. Ids a tool creates come
from counters kept *in* the environment (`_id_counters`), never from randomness or the clock,
and timestamps come from the arguments or the environment's `current_time`.

Checkpoint state (schema version 1): `{"schema_version": 1, "environment": {...}}`, copied
through JSON on export and validated in full (every state of a batch) before any is installed.

One concept a module: `tasks` (the shipped task rows), `arguments` (the tools' validated
arguments), `environment_state` (reading and changing one environment), `scoring`
(`/verify`), `errors` (how a request is refused), `server` (the resources server and its
checkpoint hooks). This package is the example's public face: what it re-exports is what the
other examples, the benchmarks and the tests use.
"""

from __future__ import annotations

from rollout_checkpoint.server.resources.json_state import SCHEMA_VERSION
from rollout_checkpoint.server.resources.json_state import (
    validate_environment_state as validate_state,
)

from .errors import RequestRefused
from .scoring import KEY_FIELDS, score
from .server import PromptInjectionServer
from .tasks import TASKS_FILE, load_tasks

__all__ = [
    "KEY_FIELDS",
    "SCHEMA_VERSION",
    "TASKS_FILE",
    "PromptInjectionServer",
    "RequestRefused",
    "load_tasks",
    "score",
    "validate_state",
]
