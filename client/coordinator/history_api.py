"""ListCheckpoints and GetCheckpoint: the checkpoint root's history (`publication.history`) as
typed RPCs, read through a cached `HistoryView` so a page costs milliseconds however long the
history is.

Page tokens are opaque to callers but not secret: base64url JSON naming the filters they were
issued for and the anchor (id, start, end) of the page's last entry. An anchor, not a
position, because the history drops its oldest entries and gains new ones between two pages:
a position would skip or repeat entries, an anchor continues exactly after the last one seen.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable, Hashable
from datetime import datetime
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from rollout_checkpoint.client.checkpointing.publication.history import (
    HistoryEntry,
    MemberRecord,
    Status,
)
from rollout_checkpoint.client.checkpointing.publication.history_view import (
    CHECKPOINT,
    RESTORE,
    Anchor,
    HistoryPage,
    HistorySnapshot,
    HistoryView,
)
from rollout_checkpoint.client.coordinator.calls import no_checkpoint_root, root_call
from rollout_checkpoint.client.fleet import FleetSpec
from rollout_checkpoint.server.core.episodes import is_valid_id
from rollout_checkpoint.server.core.errors import CheckpointError, Reason, invalid_request
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import types_pb2

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
READ_SECONDS = 30.0
"""How long a history read may take before it is STORAGE_FAILED (the requests carry no
deadline: they are reads, safe to retry)."""
_TOKEN_VERSION = 1

STATUSES = {
    cpb.ATTEMPT_STATUS_COMPLETED: Status.COMPLETED,
    cpb.ATTEMPT_STATUS_FAILED: Status.FAILED,
    cpb.ATTEMPT_STATUS_ABORTED: Status.ABORTED,
}
OPERATIONS = {
    cpb.ATTEMPT_OPERATION_CHECKPOINT: CHECKPOINT,
    cpb.ATTEMPT_OPERATION_RESTORE: RESTORE,
}
_STATUS_VALUES = {str(text): value for value, text in STATUSES.items()}
_OPERATION_VALUES = {text: value for value, text in OPERATIONS.items()}


class CheckpointHistoryApi:
    """The two history RPCs of one fleet's checkpoint root (its view is made on first use)."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self._view: HistoryView | None = None
        self._attempts = _AttemptMessages()
        self._answers = _CheckpointAnswers()
        self._reading: asyncio.Future[HistorySnapshot] | None = None

    async def list_checkpoints(
        self, request: cpb.ListCheckpointsRequest
    ) -> cpb.ListCheckpointsResponse:
        if request.page_size < 0:
            raise invalid_request("page_size", "must not be negative")
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        status = STATUSES.get(request.status, "")
        operation = OPERATIONS.get(request.operation, "")
        filters = f"status={status};operation={operation}"
        after = _anchor_of(request.page_token, filters) if request.page_token else None
        snapshot = await self._snapshot()
        # The page and its messages are built on a thread: a page of 1,000 attempts is
        # about 120 ms of CPU, which on the loop would stall every RPC of the coordinator.
        page = functools.partial(snapshot.page, status, operation, size, after)
        return await asyncio.to_thread(self._list_response, page, filters)

    def _list_response(
        self, paged: Callable[[], HistoryPage], filters: str
    ) -> cpb.ListCheckpointsResponse:
        page = paged()
        return cpb.ListCheckpointsResponse(
            checkpoints=self._attempts.of(page.snapshot, page.entries),
            next_page_token=_token_of(page.following, filters) if page.following else "",
            total_size=page.total,
            counts=cpb.AttemptCounts(**dataclasses.asdict(page.counts)),
            history_problem=page.problem or "",
        )

    async def get_checkpoint(self, request: cpb.GetCheckpointRequest) -> cpb.GetCheckpointResponse:
        if not is_valid_id(request.id):
            raise invalid_request(
                "id", "must be 1-128 characters matching ^[A-Za-z0-9][A-Za-z0-9._-]*$"
            )
        snapshot = await self._snapshot()
        if snapshot.problem is not None:
            raise CheckpointError(Reason.INVALID_CHECKPOINT_STATE, snapshot.problem)
        found = snapshot.newest(request.id)
        if found is None:
            raise CheckpointError(
                Reason.INVALID_REQUEST,
                f"the checkpoint history holds no attempt {request.id!r}",
                code="NOT_FOUND",
                field="id",
            )
        entry, details_dropped = found
        version = await self._read(self.view().details_version, entry) if entry.details else None
        cached = self._answers.get(snapshot, (request.id, version))
        if cached is not None:
            return cached
        members: tuple[MemberRecord, ...] = ()
        problem = ""
        if entry.details:
            try:
                members = await self._read(self.view().members, entry)
            except ValueError as error:
                problem = f"{entry.details}: {error}"
        response = await asyncio.to_thread(
            _checkpoint_response, entry, details_dropped, members, problem
        )
        self._answers.put(snapshot, (request.id, version), response)
        return response

    def view(self) -> HistoryView:
        """The root's history view; FAILED_PRECONDITION when the fleet file names no root."""
        if self._view is None:
            location = self.spec.checkpoint_root
            if location is None:
                raise no_checkpoint_root(": there is no checkpoint history")
            self._view = HistoryView(str(location))
        return self._view

    async def _read(self, function: Callable[..., T], *args: Any) -> T:
        location = self.view().location
        return await root_call(time.time() + READ_SECONDS, location, function, *args)

    async def _snapshot(self) -> HistorySnapshot:
        """The view's snapshot, read once for every request that arrives while a read is
        in flight. Before, each request ran its own read on a thread that queued on the
        view's lock: while the store hung, every request left one more thread blocked
        there after its deadline had answered it."""
        reading = self._reading
        if reading is None or reading.done():
            reading = self._reading = asyncio.ensure_future(self._read(self.view().snapshot))
            reading.add_done_callback(_retrieved)
        return await asyncio.shield(reading)


class _AttemptMessages:
    """The wire messages of one snapshot's entries, each made once: a dashboard polls the
    same page every few seconds, and building 50 messages from their entries is most of
    what a page costs once the index is parsed. Keyed by the entry's identity within the
    snapshot it belongs to (held here, so no identity is reused while it is cached)."""

    def __init__(self) -> None:
        self._snapshot: HistorySnapshot | None = None
        self._messages: dict[int, cpb.Attempt] = {}

    def of(self, snapshot: HistorySnapshot, entries: list[HistoryEntry]) -> list[cpb.Attempt]:
        if snapshot is not self._snapshot:
            self._snapshot, self._messages = snapshot, {}
        messages = []
        for entry in entries:
            message = self._messages.get(id(entry))
            if message is None:
                message = self._messages[id(entry)] = attempt_message(entry)
            messages.append(message)
        return messages


class _CheckpointAnswers:
    """GetCheckpoint's answers for the current snapshot, by id: an open dashboard asks for
    the same attempt every 2 s, and a 1,000-member attempt's details are ~20 ms to read and
    build. Keyed by the id and its details object's version (a stat or HEAD), so a
    details object replaced or removed is read again; a new snapshot (the index changed)
    starts afresh."""

    def __init__(self) -> None:
        self._snapshot: HistorySnapshot | None = None
        self._answers: dict[Hashable, cpb.GetCheckpointResponse] = {}

    def get(self, snapshot: HistorySnapshot, key: Hashable) -> cpb.GetCheckpointResponse | None:
        return self._answers.get(key) if snapshot is self._snapshot else None

    def put(
        self, snapshot: HistorySnapshot, key: Hashable, answer: cpb.GetCheckpointResponse
    ) -> None:
        if snapshot is not self._snapshot:
            self._snapshot, self._answers = snapshot, {}
        self._answers[key] = answer


def _checkpoint_response(
    entry: HistoryEntry, details_dropped: bool, members: tuple[MemberRecord, ...], problem: str
) -> cpb.GetCheckpointResponse:
    return cpb.GetCheckpointResponse(
        checkpoint=attempt_message(entry),
        details_dropped=details_dropped,
        members=[member_message(m) for m in members],
        details_problem=problem,
    )


def _retrieved(reading: asyncio.Future[Any]) -> None:
    """Marks a shared read's failure as seen: every waiter may have gone (its deadline)."""
    if not reading.cancelled():
        reading.exception()


def _token_of(anchor: Anchor, filters: str) -> str:
    document = {
        "v": _TOKEN_VERSION,
        "f": filters,
        "a": [anchor.id, anchor.started_at, anchor.ended_at],
    }
    raw = json.dumps(document, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _anchor_of(token: str, filters: str) -> Anchor:
    """The anchor of a page token issued for `filters`; INVALID_REQUEST otherwise."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        document = json.loads(raw)
        version, issued_for, (entry_id, started_at, ended_at) = (
            document["v"],
            document["f"],
            document["a"],
        )
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise invalid_request("page_token", "is not a page token of ListCheckpoints") from None
    if version != _TOKEN_VERSION or not all(
        isinstance(v, str) for v in (issued_for, entry_id, started_at, ended_at)
    ):
        raise invalid_request("page_token", "is not a page token of ListCheckpoints")
    if issued_for != filters:
        raise invalid_request(
            "page_token", "was issued for other filters: send the same status and operation"
        )
    return Anchor(entry_id, started_at, ended_at)


def attempt_message(entry: HistoryEntry) -> cpb.Attempt:
    """The wire form of a history entry (never its members)."""
    return cpb.Attempt(
        id=entry.id,
        operation=_OPERATION_VALUES.get(entry.operation, cpb.ATTEMPT_OPERATION_UNSPECIFIED),
        trigger=entry.trigger,
        mode=entry.mode,
        status=_STATUS_VALUES.get(entry.status, cpb.ATTEMPT_STATUS_UNSPECIFIED),
        started_at=_timestamp(entry.started_at),
        ended_at=_timestamp(entry.ended_at),
        duration_seconds=entry.duration_seconds,
        reason=entry.reason,
        message=entry.message,
        failed_members=entry.failed_members,
        stages=[cpb.AttemptStage(stage=s.stage, seconds=s.seconds) for s in entry.stages],
        members=entry.members,
        records=entry.records,
        bytes=entry.bytes,
        source=entry.source,
        continued=entry.continued,
        restarted=entry.restarted,
        has_details=bool(entry.details),
    )


def member_message(member: MemberRecord) -> cpb.AttemptMember:
    """The wire form of a member's record; a kind this version does not know is
    UNSPECIFIED, an unset duration stays unset."""
    message = cpb.AttemptMember(
        name=member.name,
        kind=_kind(member.kind),
        instance=member.instance,
        part=member.part,
        records=member.records,
        bytes=member.bytes,
        blockers_max=member.blockers_max,
        blocked_seconds=member.blocked_seconds,
        error=member.error,
    )
    for name in ("prepared_seconds", "commit_seconds", "durable_seconds", "restore_seconds"):
        seconds = getattr(member, name)
        if seconds is not None:
            setattr(message, name, seconds)
    return message


def _kind(name: str) -> types_pb2.ParticipantKind.ValueType:
    try:
        return types_pb2.ParticipantKind.Value(f"PARTICIPANT_KIND_{name.upper()}")
    except ValueError:
        return types_pb2.PARTICIPANT_KIND_UNSPECIFIED


def _timestamp(text: str) -> timestamp_pb2.Timestamp:
    """An entry's ISO time as a Timestamp (unset when it does not parse: a hand-edited index
    must not fail the whole page)."""
    stamp = timestamp_pb2.Timestamp()
    with contextlib.suppress(ValueError):
        stamp.FromDatetime(datetime.fromisoformat(text))
    return stamp
