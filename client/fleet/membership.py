"""Who is in the fleet right now: every member watched through its health stream and its boot id.

A supervisor must learn that a member was *replaced* (its process and its in-memory state are
gone), not only that it is down: a replacement that comes back on the same address within a
probe interval looks healthy to a poll of the health service alone. So each member is watched
two ways, and neither alone would do:

* its `participant-liveness` health stream (grpc.health.v1 Watch), which breaks the moment
  the process dies or its connection drops, so a crash is seen at once, not at the next poll;
* its boot id (`GetParticipant`), read whenever the stream (re)opens and at least every
  `probe_seconds`: a new boot id is a new process, whatever the health stream said. A member
  that serves no health service (UNIMPLEMENTED) is watched by this probe alone, rather than
  reported down and up again every probe.

A member that is down is probed on a fresh channel every time (`RETRY_SECONDS`, at most
`MAX_RETRY_SECONDS` apart), never on the channel that lost it: a channel's subchannel backs off
between connection attempts (gRPC's default: 1 s, x1.6 per failure, up to 120 s), and a call
made while it backs off fails at once without dialling. Reused, that channel saw a replacement
started after a 150 s outage up to 45 s late, and a replacement that lived one second not at
all. A fresh channel dials at its first call (it takes a subchannel of its own:
`ParticipantClient`). So a replacement is seen within `MAX_RETRY_SECONDS` of listening,
whatever the outage's length.

The watch keeps no opinion about what to do: it reports `MemberEvent`s (UP, DOWN, REPLACED) to
one callback, in order per member. The supervisor (`coordinator.supervisor`) and `collect`
decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import FleetSpec, Kind, MemberSpec
from rollout_checkpoint.client.participant import LIVENESS_HEALTH, ParticipantClient
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE

PROBE_SECONDS = 2.0
"""How often a member's boot id is read while its health stream stays up."""
RETRY_SECONDS = 0.25
"""How soon a member that is down is probed again (doubling up to `MAX_RETRY_SECONDS`): a
replacement is usually up within a second or two, and every second it waits unnoticed is a
second the fleet stays closed."""
MAX_RETRY_SECONDS = 0.5
"""The longest a replacement that listens waits to be seen (plus one connection): a probe of a
member that is down is a TCP connection attempt on a fresh channel, cheap enough to make twice
a second."""


class Change(enum.StrEnum):
    """What happened to a member."""

    UP = "up"
    """It answers: the first time, or again with the same boot id (a network blip)."""
    DOWN = "down"
    """It stopped answering (its health stream broke, or a probe failed)."""
    REPLACED = "replaced"
    """It answers with a new boot id: a new process, whose state starts empty."""


@dataclass(frozen=True)
class MemberEvent:
    """One change of one member. `boot_id`, `kind` and `instance` are the member's as last
    seen (empty / UNSPECIFIED while it never answered); `previous_boot_id` is set for
    REPLACED; `detail` says why (the transport error of a DOWN)."""

    name: str
    """The member's fleet-file name."""
    address: str
    """Its sidecar's gRPC address."""
    change: Change
    """What happened (`Change`)."""
    boot_id: str = ""
    """Its boot id as last seen (empty while it never answered)."""
    previous_boot_id: str = ""
    """REPLACED only: the boot id of the process that was lost."""
    kind: Kind = types_pb2.PARTICIPANT_KIND_UNSPECIFIED
    """Its kind as last seen (UNSPECIFIED while it never answered)."""
    instance: str = ""
    """Its instance as last seen (empty while it never answered)."""
    detail: str = ""
    """Why, for a DOWN: the transport error."""
    at: float = 0.0
    """When it was seen (`time.time()`)."""


OnEvent = Callable[[MemberEvent], None]


class FleetWatch:
    """Watches every member of a fleet file until `close`, reporting changes to `on_event`.

    `known` seeds the boot ids (from a discovery made before): a member that answers with
    another one is REPLACED at once, rather than UP. `boot_ids()` and `down()` tell the
    current picture at any time."""

    def __init__(
        self,
        spec: FleetSpec,
        on_event: OnEvent,
        *,
        known: dict[str, str] | None = None,
        probe_seconds: float = PROBE_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self.spec = spec
        self._on_event = on_event
        self._boot_ids: dict[str, str] = dict(known or {})
        self._down: set[str] = set()
        self._probe_seconds = probe_seconds
        self._retry_seconds = retry_seconds
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start one watcher task per member (on the running loop)."""
        credentials = self.spec.credentials()
        for member in self.spec.members:
            task = asyncio.get_running_loop().create_task(self._watch(member, credentials))
            self._tasks.append(task)

    async def close(self) -> None:
        """Stop every watcher (each closes its channel); idempotent."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def boot_ids(self) -> dict[str, str]:
        """The boot id each member last answered with (members never seen are left out)."""
        return dict(self._boot_ids)

    def down(self) -> frozenset[str]:
        """The members that do not answer now."""
        return frozenset(self._down)

    # -- one member ---------------------------------------------------------------------

    async def _watch(self, member: MemberSpec, credentials: grpc.ChannelCredentials | None) -> None:
        retry = self._retry_seconds
        client: ParticipantClient | None = None
        try:
            while True:
                if client is None:
                    client = self.spec.client(
                        member, timeout=max(1.0, self._probe_seconds), credentials=credentials
                    )
                try:
                    info = await client.get_participant()
                except ControlError as error:
                    _unless_cancelled()
                    self._went_down(member, str(error.message or error.code.name))
                    lost, client = client, None  # reused, it would back off: the next probe dials
                    await lost.close()
                    await asyncio.sleep(retry)
                    retry = min(MAX_RETRY_SECONDS, retry * 2)
                    continue
                retry = self._retry_seconds
                self._answered(member, info.boot_id, info.kind, info.instance)
                try:
                    await asyncio.wait_for(self._follow_health(client), self._probe_seconds)
                except TimeoutError:
                    continue  # read the boot id again: a replacement keeps the stream short
                except ControlError as error:
                    _unless_cancelled()
                    if error.code == grpc.StatusCode.UNIMPLEMENTED:
                        # A participant without the health service: it answered
                        # GetParticipant, so it is up; only its boot id, read every probe,
                        # can tell a crash.
                        await asyncio.sleep(self._probe_seconds)
                        continue
                    self._went_down(member, str(error.message or error.code.name))
                    lost, client = client, None
                    await lost.close()
        finally:
            if client is not None:
                await client.close()

    async def _follow_health(self, client: ParticipantClient) -> None:
        """Return when the member announces that it is going away; raise when the stream
        breaks (`ControlError`)."""
        async for status in client.watch_health(LIVENESS_HEALTH):
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                raise ControlError(UNAVAILABLE, "the member announced it is shutting down")
        raise ControlError(UNAVAILABLE, "the member's health stream ended")

    def _answered(self, member: MemberSpec, boot_id: str, kind: Kind, instance: str) -> None:
        previous = self._boot_ids.get(member.name)
        self._boot_ids[member.name] = boot_id
        was_down = member.name in self._down
        self._down.discard(member.name)
        if previous is not None and previous != boot_id:
            change = Change.REPLACED
        elif previous is None or was_down:
            change = Change.UP
        else:
            return
        self._emit(
            MemberEvent(
                member.name,
                member.address,
                change,
                boot_id=boot_id,
                previous_boot_id=(previous or "") if change is Change.REPLACED else "",
                kind=kind,
                instance=instance,
            )
        )

    def _went_down(self, member: MemberSpec, detail: str) -> None:
        if member.name in self._down:
            return
        self._down.add(member.name)
        self._emit(
            MemberEvent(
                member.name,
                member.address,
                Change.DOWN,
                boot_id=self._boot_ids.get(member.name, ""),
                detail=detail,
            )
        )

    def _emit(self, event: MemberEvent) -> None:
        event = dataclasses.replace(event, at=time.time())
        log.info("member %s %s %s", event.name, event.change.value, event.detail)
        try:
            self._on_event(event)
        except Exception:  # a failing listener must not stop the watch of this member
            log.exception("the member-event listener failed")


def _unless_cancelled() -> None:
    """Raise `CancelledError` when the task is being cancelled: grpc aio may answer the
    cancellation of a task awaiting a call with the call's CANCELLED status instead, and a
    watcher that took that for a member down would swallow its own `close`, for good."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
