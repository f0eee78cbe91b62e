"""The wire's values as the CLI shows and parses them: participant state names, RFC 3339
times, the `--episode` argument.

One place for each, so every verb prints a state or a time the same way and a new value in the
protos shows up everywhere at once (the state names are derived from `types.proto`, never
re-typed). The health names live with the client that watches them
(`participant.READINESS_HEALTH` and its siblings, derived from `constants.proto`): the member
watch under `collect` and the supervisor needs them without the CLI's verbs."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import types_pb2

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"
STATE_PREFIX = "PARTICIPANT_STATE_"


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
