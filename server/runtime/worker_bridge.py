"""The worker's end of a multi-worker server: its participant, driven from the main process.

A server with several workers is still one participant: the main process holds the control
plane and the gRPC sidecar (workers.py, worker_pool.py); each worker runs the data plane and
its own share of the state (the sessions it seeded, the episodes it runs) behind the same
`Participant` a one-process server uses. This module is what stands in for the control
plane inside a worker: a `ParticipantContext` (the retired marks, `changed()`), and the
bridge connection that carries the main process's calls to the participant and the
participant's readiness back.

A worker opens no control port of its own: it finds the main process through
`WORKER_SOCKET_ENV` (a Unix socket in a directory only this user can enter) and knows its
place by `WORKER_INDEX_ENV`. It registers before its HTTP server accepts anything, and takes
the main process's admission state in the reply: a worker that (re)starts while a checkpoint
is open closes at once, before its first request, so it can never serve across a cut. When
the main process goes away the worker stops itself: a data plane with nobody to close it
would serve through the next checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.server.runtime.attempts import RetiredAttempts
from rollout_checkpoint.server.runtime.participant import Participant, RestoredRecord
from rollout_checkpoint.server.runtime.records_codec import serialize_records
from rollout_checkpoint.server.runtime.result_outbox import Lookup, Produced, unbridged_result
from rollout_checkpoint.server.runtime.worker_changes import WorkerShares
from rollout_checkpoint.server.runtime.worker_link import Link, LinkClosed, WorkerCallFailed

log = logging.getLogger(__name__)

WORKER_SOCKET_ENV = "ROLLOUT_CHECKPOINT_WORKER_SOCKET"
"""Set by the main process for its workers: the bridge socket's path."""
WORKER_INDEX_ENV = "ROLLOUT_CHECKPOINT_WORKER_INDEX"
"""Set by the main process for its workers: this worker's place, 0..N-1 (a restarted worker
takes the place of the one that died)."""
WORKER_COUNT_ENV = "ROLLOUT_CHECKPOINT_WORKERS"
"""Set by the main process for its workers: how many workers it runs (session routing)."""
WORKER_HTTP_FD_ENV = "ROLLOUT_CHECKPOINT_WORKER_HTTP_FD"
"""Set by the main process for its workers: the shared listening HTTP socket, inherited."""
WORKER_DIR_ENV = "ROLLOUT_CHECKPOINT_WORKER_DIR"
"""Set by the main process for its workers: the private directory of the sockets."""
OPEN_PUSH_SECONDS = 0.25
"""While admission is open a worker's readiness matters to nobody at once (no Prepare waits
on it): its changes are pushed at most this often. While closed they go at once."""


def worker_index() -> int | None:
    """This process's worker index, or None outside a multi-worker server."""
    value = os.environ.get(WORKER_INDEX_ENV)
    return int(value) if value is not None and os.environ.get(WORKER_SOCKET_ENV) else None


def worker_count() -> int:
    """How many workers this process's server runs (1 outside a multi-worker server)."""
    return int(os.environ.get(WORKER_COUNT_ENV, "1")) if worker_index() is not None else 1


def worker_http_socket(index: int) -> str:
    """The path of worker `index`'s own HTTP socket (requests forwarded to their owner)."""
    return os.path.join(os.environ[WORKER_DIR_ENV], f"w{index}.http")


def episode_keys(episodes: Sequence[EpisodeId] | frozenset[EpisodeId] | None) -> Any:
    return None if episodes is None else sorted(e.capture_key for e in episodes)


def episodes_from(keys: Any) -> list[EpisodeId]:
    return [EpisodeId.from_capture_key(k) for k in keys]


class WorkerBridge:
    """The participant's control-plane stand-in inside one worker (its `ParticipantContext`).

    Created by `install_checkpointing` when `WORKER_SOCKET_ENV` is set; `connect` (from the
    app's lifespan) registers with the main process before the first request."""

    def __init__(self, participant: Participant, socket_path: str, index: int) -> None:
        self.participant = participant
        self.socket_path = socket_path
        self.index = index
        self.retired_attempts = RetiredAttempts()
        self._generation = 0
        self._closed = False
        self._sealed = False
        self._shutting_down = False
        self._link: Link | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._push_handle: asyncio.Handle | None = None
        self._report_handle: asyncio.Handle | None = None
        self._shares = WorkerShares(participant)
        participant.attach(self)

    # -- ParticipantContext --------------------------------------------------------------

    @property
    def retired(self) -> RetiredAttempts:
        return self.retired_attempts

    def changed(self) -> None:
        """Push this worker's readiness to the main process: at once while closed (a
        Prepare waits on it), and its inventory (episodes, restored pending, served) at most
        every `OPEN_PUSH_SECONDS`: listing every session on each request that ends during a
        Prepare would cost O(sessions) per request."""
        if self._link is None:
            return
        loop = asyncio.get_running_loop()
        if self._closed and self._report_handle is None:
            self._report_handle = loop.call_soon(self._push_report)
        if self._push_handle is None:
            self._push_handle = loop.call_later(OPEN_PUSH_SECONDS, self._push)

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def start_closed_pending(self) -> bool:
        return self._sealed

    async def claim(self, episode: EpisodeId) -> RestoredRecord | None:
        """Claim the restored record of `episode` (attempt N+1) held by the main process:
        returns it to exactly one worker, None when there is none. Refused (the
        `CheckpointError` of the main process) while a checkpoint is open."""
        if self._link is None:
            return None
        reply = await self._link.call("claim", {"episode": episode.capture_key})
        if reply is None:
            return None
        return RestoredRecord(EpisodeId.from_capture_key(reply["checkpointed"]), reply["fields"])

    @property
    def remote_outbox(self) -> BridgedOutbox:
        """The result outbox of this server: the main process's, one for every worker, so a
        late run finds its result whichever worker it reaches (result_outbox.py)."""
        return BridgedOutbox(self)

    async def outbox_call(self, op: str, body: Any) -> Any:
        """A call to the main process's outbox; None without a connection."""
        if self._link is None:
            return None
        return await self._link.call(op, body)

    # -- connection ----------------------------------------------------------------------

    async def connect(self) -> None:
        """Register with the main process and take its admission state and marks."""
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        link = Link(reader, writer, handler=self._handle, listener=self._on_message)
        self._link = link
        self._reader_task = asyncio.get_running_loop().create_task(self._read(link))
        reply = await link.call(
            "register",
            {
                "index": self.index,
                "pid": os.getpid(),
                "facts": self._facts(),
                "incremental": self.participant.incremental,
            },
        )
        self._apply_marks(reply.get("marks") or {})
        if reply.get("closed"):
            self._close(reply["generation"], bool(reply.get("sealed")))
        self._push()

    async def disconnect(self) -> None:
        self._shutting_down = True
        if self._link is not None:
            self._link.close()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)

    async def _read(self, link: Link) -> None:
        await link.run()
        if not self._shutting_down:
            log.error("worker %d lost its main process: stopping", self.index)
            os.kill(os.getpid(), signal.SIGTERM)

    # -- calls from the main process -----------------------------------------------------

    def _on_message(self, op: str, body: Any) -> None:
        """The main process's messages (no reply), in the order sent; they must not await,
        as the pool sends them from the participant's synchronous methods."""
        participant = self.participant
        if op == "close":
            self._close(body["generation"], bool(body.get("sealed")))
        elif op == "open":
            self._apply_marks((body or {}).get("marks") or {})
            if self._closed:
                self._closed = False
                self._sealed = False
                participant.open_admission()
        elif op == "forget":
            self.retired_attempts.forget(body["rollouts"])
            participant.forget(body["rollouts"])
        elif op == "forget_served":
            participant.forget_served()
        elif op == "committed":
            scope = body.get("scope")
            participant.committed(None if scope is None else frozenset(episodes_from(scope)))
        elif op == "shutting_down":
            self._shutting_down = True
            participant.shutting_down_now()
        else:
            log.warning("unknown bridge message %r", op)
            return
        self._push()

    async def _handle(self, op: str, body: Any) -> Any:
        participant = self.participant
        if op == "export":
            scope = body.get("scope")
            records = await participant.export(
                None if scope is None else frozenset(episodes_from(scope))
            )
            # Encoded here, in a thread, with the part's own codec: a value JSON cannot carry
            # fails the Commit UNSERIALIZABLE_STATE naming its episode, as in one process,
            # and the main process stores exactly these lines' content.
            lines = await asyncio.to_thread(lambda: list(serialize_records(records)))
            return [line.decode() for line in lines]
        elif op == "export_changes":
            scope = body.get("scope")
            return await self._shares.export(
                None if scope is None else frozenset(episodes_from(scope)),
                int(body["cut"]),
                body.get("base"),
            )
        elif op == "install":
            self._apply_marks(body.get("marks") or {})
            await participant.install(_records(body["records"]))
        elif op == "validate":
            validate = getattr(participant, "validate_record", None)
            if validate is not None:
                for record in _records(body["records"]):
                    validate(record)
        elif op == "discard":
            await participant.discard_installed(episodes_from(body["episodes"]))
        elif op == "retire":
            episode = EpisodeId.from_capture_key(body["episode"])
            self.retired_attempts.mark(episode)
            await participant.retire(episode)
        elif op != "state":  # `state` asks for the push below, nothing else
            raise ValueError(f"unknown bridge call {op!r}")
        self._push()  # before the reply: the main process reads the state first
        return None

    def _close(self, generation: int, sealed: bool) -> None:
        self._generation = generation
        self._sealed = sealed
        if not self._closed:
            self._closed = True
            self.participant.close_admission()

    def _apply_marks(self, marks: Mapping[str, int]) -> None:
        for rollout_id, attempt in marks.items():
            self.retired_attempts.mark(EpisodeId(rollout_id, attempt))

    def _facts(self) -> dict[str, str]:
        return dict(self.participant.facts())

    def _report(self) -> dict[str, Any]:
        report = self.participant.report()
        return {
            "generation": self._generation,
            "closed": self._closed,
            "ready": report.ready,
            "blockers": [[b.capture_key, b.reason.value, b.detail] for b in report.blockers],
            "blocker_count": report.blocker_count,
            "counts": dict(report.counts),
        }

    def _push_report(self) -> None:
        """The readiness report alone (O(blockers listed)): what a waiting Prepare needs."""
        self._report_handle = None
        link = self._link
        if link is not None and not link.closed:
            with contextlib.suppress(LinkClosed):
                link.send("report", self._report())

    def _push(self) -> None:
        """The readiness report and the inventory (O(episodes held))."""
        if self._push_handle is not None:
            self._push_handle.cancel()
            self._push_handle = None
        if self._report_handle is not None:
            self._report_handle.cancel()
            self._report_handle = None
        link = self._link
        if link is None or link.closed:
            return
        participant = self.participant
        state = self._report() | {
            "served": participant.has_served(),
            "restored_pending": episode_keys(participant.restored_pending()),
            "episodes": [
                [
                    i.episode_id.capture_key,
                    i.at_boundary,
                    i.restored_pending,
                    i.oldest_weight_version,
                ]
                for i in participant.episodes()
            ],
            "counters": dict(participant.counters()),
        }
        with contextlib.suppress(LinkClosed):
            link.send("state", state)


def _records(items: Any) -> list[RestoredRecord]:
    return [
        RestoredRecord(EpisodeId.from_capture_key(item["checkpointed"]), item["fields"])
        for item in items
    ]


class BridgedOutbox:
    """A worker's access to the main process's outbox (`receipts.OutboxAccess`)."""

    def __init__(self, bridge: WorkerBridge) -> None:
        self._bridge = bridge

    async def lookup(self, episode: EpisodeId, route: str) -> Lookup:
        reply = await self._bridge.outbox_call(
            "outbox_lookup", {"episode": episode.capture_key, "route": route}
        )
        if reply is None:
            return Lookup(None, False)
        held = reply["held"]
        return Lookup(None if held is None else unbridged_result(held), bool(reply["full"]))

    async def put(self, produced: Produced) -> Receipt | None:
        """None when the main process cannot be reached: the reply then carries no receipt
        (the server is going down with its main process anyway)."""
        try:
            reply = await self._bridge.outbox_call("outbox_put", produced.bridged())
        except WorkerCallFailed:
            log.warning("the result of %s could not be held: no main process", produced.episode)
            return None
        return None if reply is None else Receipt.from_json(reply)
