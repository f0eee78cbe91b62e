"""The wire's values as the CLI shows and parses them: RFC 3339 times, the `--episode`
argument, and (re-exported) participant state names.

One place for each, so every verb prints a state or a time the same way and a new value in the
protos shows up everywhere at once. The state names (derived from `types.proto`, never
re-typed) and the health names (`participant.READINESS_HEALTH` and its siblings, derived from
`constants.proto`) live with the participant client: the coordinator's dashboard, the member
watch under `collect` and the supervisor need them without the CLI's verbs."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from rollout_checkpoint.client.participant import state_name
from rollout_checkpoint.server.core.episodes import EpisodeId

__all__ = ["EPISODE_FORMAT", "TOKEN_ENV", "episode_arg", "rfc3339", "state_name"]

TOKEN_ENV = "ROLLOUT_CHECKPOINT_TOKEN"


EPISODE_FORMAT = (
    "--episode: a rollout id (`r7`, attempt 1) or a capture key `<rollout_id>-a<attempt>` "
    "(`r7-a2`); repeat the flag for several."
)


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
