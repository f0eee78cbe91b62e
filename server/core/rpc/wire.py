"""Conversions between wire messages and values, and the request checks both servers share.

Seconds <-> `google.protobuf.Timestamp`/`Duration`, `EpisodeId` <-> its message, and the
validation of deadlines and episode lists (ParticipantService and CoordinatorService refuse
the same bad input with the same `INVALID_REQUEST`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from rollout_checkpoint.server.core.episodes import MAX_ATTEMPT, EpisodeId, rollout_id_problem
from rollout_checkpoint.server.core.errors import invalid_request
from rollout_checkpoint.v1 import types_pb2

MAX_TIMESTAMP_SECONDS = 253402300799  # 9999-12-31T23:59:59Z, the Timestamp range


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def deadline_of(request: Any, field: str = "deadline") -> float:
    """The request's absolute deadline in seconds; INVALID_REQUEST when it is missing or out
    of the Timestamp range (checked before any conversion: protobuf raises ValueError on
    nanos out of range, which would surface as INTERNAL)."""
    if not request.HasField(field):
        raise invalid_request(field, "is required (an absolute google.protobuf.Timestamp)")
    stamp: timestamp_pb2.Timestamp = getattr(request, field)
    if not 0 <= stamp.nanos < 1_000_000_000 or not 0 < stamp.seconds <= MAX_TIMESTAMP_SECONDS:
        raise invalid_request(field, "is not a valid timestamp")
    return stamp.seconds + stamp.nanos / 1e9


def episode_message(episode: EpisodeId) -> types_pb2.EpisodeId:
    return types_pb2.EpisodeId(rollout_id=episode.rollout_id, attempt=episode.attempt)


def scope_message(episodes: Iterable[EpisodeId]) -> types_pb2.EpisodeScope:
    return types_pb2.EpisodeScope(episodes=[episode_message(e) for e in sorted(set(episodes))])


def episode_id(message: types_pb2.EpisodeId, field: str) -> EpisodeId:
    """The episode a message names; INVALID_REQUEST naming `field` when it is not one."""
    problem = rollout_id_problem(message.rollout_id)
    if problem is not None:
        raise invalid_request(f"{field}.rollout_id", problem)
    if message.attempt > MAX_ATTEMPT:
        raise invalid_request(f"{field}.attempt", f"must be at most {MAX_ATTEMPT}")
    return EpisodeId(message.rollout_id, message.attempt)


def episode_ids(messages: Iterable[types_pb2.EpisodeId], field: str) -> list[EpisodeId]:
    """`episode_id` of each message, in order (`field[i]` names the offending one)."""
    return [episode_id(message, f"{field}[{i}]") for i, message in enumerate(messages)]
