"""The wire's values as the CLI shows and parses them: participant state names, health
service names, RFC 3339 times, the `--episode` argument.

One place for each, so every verb prints a state, a time or a health name the same way and a
new value in the protos shows up everywhere at once (the state names are derived from
`types.proto`, the health names from `constants.proto`, never re-typed)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import constants_pb2, types_pb2

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"
STATE_PREFIX = "PARTICIPANT_STATE_"


def _health_name(value: constants_pb2.HealthServiceName.ValueType) -> str:
    """The wire string of a `HealthServiceName` (its `wire_value` option in constants.proto)."""
    descriptor = constants_pb2.HealthServiceName.DESCRIPTOR.values_by_number[value]
    name: str = descriptor.GetOptions().Extensions[constants_pb2.wire_value]
    return name


READINESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS)
LIVENESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS)
SERVER_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_SERVER)

EPISODE_FORMAT = (
    "--episode: a rollout id (`r7`, attempt 1) or a capture key `<rollout_id>-a<attempt>` "
    "(`r7-a2`); repeat the flag for several."
)


def state_name(state: int, unknown: str) -> str:
    """A participant state's name in types.proto without its prefix (`IDLE`); `unknown` for
    UNSPECIFIED and for a value this version does not know."""
    if state == types_pb2.PARTICIPANT_STATE_UNSPECIFIED:
        return unknown
    try:
        return types_pb2.ParticipantState.Name(state).removeprefix(STATE_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return unknown


def rfc3339(seconds: float) -> str:
    """Epoch seconds as RFC 3339 UTC (`2026-12-01T12:00:00.000000Z`): one time format in
    every output of the CLI."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def episode_arg(text: str) -> EpisodeId:
    """`rollout_id` or a capture key such as `r-a2`; argparse turns the error into usage."""
    try:
        return EpisodeId.from_capture_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
