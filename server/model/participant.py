"""The policy-model participant and its ASGI middleware.

The policy model prepares before the agents, and it never waits for generation:

* With admission closed, new generation calls are refused (409 `admission_closed`). To the
  agent that means "you are at the boundary before this call": it parks and re-issues the
  call after resume. A `start_closed` process refuses them `awaiting_restore` until its
  controller's Restore or Resume (no checkpoint is in progress; the caller retries the same).
* Calls admitted before the close keep running, but their response is *held* until resume
  unless it already started streaming. An undelivered response leaves its agent at the
  boundary before the call, which a restored agent simply re-issues — so the only blockers
  are responses already streaming.
* The record of an episode is its ledger of *delivered* calls (request digest and response):
  a held or undelivered call is not part of the cut (ledger.py). A commit needs an explicit
  scope: the model cannot tell a finished episode from one between two calls, so it cannot
  say which ledgers an unscoped commit ("every live episode") means.
* For the same reason ListEpisodes lists only the episodes live *here*: a call in flight or
  held, or a restored ledger no call claimed yet. An episode between calls is listed by its
  agent, so a derived scope still names it and its ledger is exported.
* A ledger is released when the episode's owner says the episode finished (below), at the
  first successful commit whose scope leaves it out while no call of it runs or is held (the
  scope is every episode the controller continues), and when its rollout is retired or
  forgotten. Listing every ledger, or keeping it, grew every derived checkpoint and the
  model's memory with every episode the fleet ever ran.
* **Episode finished.** The model cannot tell a finished episode from one between two calls,
  but its owner can: once the owner's final reply of an episode was handed over, it sends
  `POST /ng-rollout/<capture_key>/ng-checkpoint/episode-finished` (`EPISODE_FINISHED_PATH`;
  204, never refused by admission) and the model drops that episode's ledger, restored or
  not. The example agent does it after its `/run` reply left; so a fleet driven by any
  controller, never checkpointing, keeps ledgers only for the episodes in flight. Why it is
  safe at any moment: (1) a rollout still going on never loses its ledger, because only its
  owner sends this and only after the episode's final reply left (a refused duplicate start
  or a retired run sends nothing); (2) a checkpoint taken after the release may still name
  the episode (an environment that prepared first holds the agent's reply unread, so its
  cut is before the relay), but the agent's part then carries the finished outcome, and its
  restored replacement delivers that outcome without ever calling the model: the ledger is
  not needed, and one exported beside a re-run would only be wrong; (3) a checkpoint taken
  before the release already holds the ledger and is unaffected. A call of the episode
  still running when the signal comes (one its agent abandoned) keeps the ledger until the
  last such call ends, so a late delivery cannot re-create it. An owner that never sends the
  signal (a third-party agent) loses nothing: its ledgers go at the next commit as before.
* Retire cancels the attempt's calls in flight and drops its ledger.
* **Generation cuts** (generation_cuts.py; the staging round: cut_staging.py): with a
  backend, a Prepare's close stages the prefix generated so far of every undelivered call
  (one round, at most half the Prepare time left, a `STAGING_GENERATION_CUTS` blocker
  meanwhile; a failure only costs regeneration), and the record becomes
  `{"calls": [...], "generation_cut": {...}}` (at most one cut per episode; a record without
  one is read as before). The restored re-issued call whose conversation digest
  matches gets the prefix attached (`PREFIX_KEY` on its scope) and the backend continues it.
  A resume without a crash drops the staged cuts: the calls go on and deliver.

* **Weight versions.** A trainer sets the version of the policy weights that serve
  (`set_weight_version`, the SetWeightVersion RPC). Each call is stamped with the version
  current when it was admitted: its reply carries `x-weight-version: <n>` (`WEIGHT_VERSION_HEADER`)
  and its ledger row `"weight_version"`, so a checkpoint keeps what every delivered call was
  sampled under, and ListEpisodes reports an episode's `oldest_weight_version` (live and
  restored ledgers alike). A response held across a checkpoint keeps its admission's
  version: it was sampled under those weights, whatever the trainer set meanwhile.

The middleware works for any ASGI app that serves `/v1/chat/completions` (or `/v1/responses`,
`/v1/messages`), including a thin proxy in front of a real OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import rejected_checkpoint
from rollout_checkpoint.server.model.cut_staging import CutStaging
from rollout_checkpoint.server.model.generation_cuts import (
    CALL_KEY,
    PREFIX_KEY,
    GenerationBackend,
    GenerationCut,
    conversation_digest,
)
from rollout_checkpoint.server.model.ledger import (
    WEIGHT_VERSION_KEY,
    Ledger,
    ModelCall,
    restored_ledger,
)
from rollout_checkpoint.server.runtime.participant import (
    AWAITING_RESTORE,
    AWAITING_RESTORE_DETAIL,
    Blocker,
    BlockerReason,
    ChangeSet,
    EpisodeInfo,
    ExportBase,
    ExportRecord,
    Kind,
    Participant,
    ReadinessReport,
    RestoredRecord,
    UnchangedRecord,
)
from rollout_checkpoint.server.runtime.record_stamps import RecordStamps
from rollout_checkpoint.server.runtime.refusals_http import send_refusal
from rollout_checkpoint.server.runtime.request_endings import cancel_request
from rollout_checkpoint.server.runtime.rollout_prefix import episode_of

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})
WEIGHT_VERSION_HEADER = b"x-weight-version"
"""The reply header of every generation call: the weight version it was admitted under."""
EPISODE_FINISHED_PATH = "/ng-checkpoint/episode-finished"
"""`POST` under a rollout prefix: the episode's owner delivered its final reply, so the model
drops the episode's ledger (the module docstring says why that is safe). Answered 204 by the
middleware, whatever the phase; never reaches the app (nor a proxied upstream)."""


class ModelParticipant(Participant):
    """The policy model's participant (the module docstring states its rules).

    `ModelAdmissionMiddleware` calls the data-plane methods around each generation call. It
    requires a commit scope (`SCOPE_REQUIRED` otherwise): its ledgers may cover episodes
    that finished without their owner saying so (an agent that never calls
    `EPISODE_FINISHED_PATH`), so an unscoped commit would export all of them. `committed`
    releases those a commit left out, and `episode_finished` those whose owner said so:
    without them the model kept every episode it ever served (`ledgers` grew by one per
    rollout: 10,050 ledgers and 2.98x the memory after 10,000 rollouts with no checkpoint)."""

    requires_scope = True

    def __init__(
        self,
        instance: str,
        *,
        backend: GenerationBackend | None = None,
        incremental: bool = False,
    ) -> None:
        """`incremental`: reference the ledgers unchanged since the last published part
        instead of storing them again (`export_changes` says why that is safe for this
        participant whatever the server behind it does). Measured at 2,000 episodes of three
        delivered calls, 10 % with a new delivery: pause 0.22x, bytes 0.16x
        (benchmarks/episodic_incremental.py). Off by default like every opt-in: a reader of
        the model's records files that does not resolve reference lines (a tool reading
        them raw) would misread a chained part."""
        self.kind = Kind.MODEL
        self.instance = instance
        self.incremental = incremental
        self._stamps: RecordStamps[EpisodeId] = RecordStamps(
            lambda e: e in self.ledgers or e in self.restored
        )
        """The last change of each episode's record: a delivery into its ledger, a claim of
        its restored ledger, an install, or the end of a generation cut exported with it."""
        self.backend = backend
        """The inference backend that stages generation cuts (None: no cuts; a cut call is
        generated again from scratch after a restore)."""
        self._staging = CutStaging(lambda: self.context.changed())
        self._admitted = 0
        self.calls: set[ModelCall] = set()
        self.ledgers: dict[EpisodeId, Ledger] = {}
        self.restored: dict[EpisodeId, Ledger] = {}
        self._installed: set[EpisodeId] = set()
        """Episodes whose ledger `install` put here: what `discard_installed` may drop."""
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._finished_while_busy: set[EpisodeId] = set()
        """Episodes whose owner said they finished while a call of theirs still ran: their
        ledger goes when the last such call ends (`call_finished`)."""
        self._served = False
        """A call of an episode reached the model (sticky): see `has_served`."""
        self._shutting_down = False
        self.weight_version = 0
        """The version of the policy weights serving now: what new calls are stamped with."""

    # -- data plane ---------------------------------------------------------------------

    @property
    def admission_open(self) -> bool:
        """False from Prepare until Resume: new generation calls are refused."""
        return self._open

    def refusal(self, episode: EpisodeId | None) -> tuple[str, str] | None:
        """`(code, detail)` of the 409 a new call of `episode` gets, or None to admit it:
        `stale_attempt` for a retired attempt, `awaiting_restore` in a `start_closed` process
        before its Restore or Resume, `admission_closed` during a checkpoint."""
        if episode is not None and self.context.retired.is_retired(episode):
            return "stale_attempt", f"attempt {episode.capture_key} was retired"
        if self.context.start_closed_pending:
            return AWAITING_RESTORE, AWAITING_RESTORE_DETAIL
        if not self._open:
            return (
                "admission_closed",
                "a checkpoint is in progress: park at the boundary and re-issue after resume",
            )
        return None

    def call_started(self, episode: EpisodeId | None, request_body: bytes) -> ModelCall:
        """Track an admitted call (the caller must `call_finished` it in a `finally`); the
        first call of a restored replacement claims its ledger, so the lineage continues."""
        if episode is not None:
            self._served = True
        self._admitted += 1
        call = ModelCall(
            episode,
            hashlib.sha256(request_body).hexdigest(),
            asyncio.current_task(),
            body=request_body,
            sequence=self._admitted,
            weight_version=self.weight_version,
        )
        self.calls.add(call)
        if episode is not None and episode in self.restored:
            # The replacement's first call claims the restored ledger: its lineage continues.
            ledger = self.ledgers[episode] = self.restored.pop(episode)
            cut, ledger.cut = ledger.cut, None
            self._stamps.touch(episode)
            if cut is not None and conversation_digest(request_body) == cut.conversation_sha256:
                call.prefix = cut.prefix  # the re-issued call: its backend continues the prefix
        self.context.changed()
        return call

    def streaming_started(self, call: ModelCall) -> None:
        """The response began streaming to the caller: it can no longer be held, so the call
        blocks a checkpoint (`STREAMING_RESPONSE`) until it ends."""
        call.streaming = True
        self.context.changed()

    async def hold_until_open(self, call: ModelCall) -> bool:
        """Hold a finished, not-yet-delivered response while a checkpoint is open.

        False when the server shuts down first: the response is never delivered (503)."""
        while not self._open and not self._shutting_down:
            call.held = True
            self.context.changed()
            await self._opened.wait()
            await asyncio.sleep(0)  # stay held if a new checkpoint closed right away
        if call.held:
            call.held = False
            self.context.changed()
        return not self._shutting_down

    def delivered(self, call: ModelCall, response_body: bytes) -> None:
        """The whole response reached the caller: append it to the episode's ledger (a body
        that is not JSON is kept as its digest). No-op for a call without an episode."""
        if call.episode is None:
            return
        try:
            response: Any = json.loads(response_body) if response_body else None
        except ValueError:
            response = {"raw_sha256": hashlib.sha256(response_body).hexdigest()}
        ledger = self.ledgers.setdefault(call.episode, Ledger())
        self._stamps.touch(call.episode)
        ledger.append(
            {
                "request_sha256": call.request_sha256,
                "response": response,
                WEIGHT_VERSION_KEY: call.weight_version,
            }
        )

    def call_finished(self, call: ModelCall) -> None:
        """Stop tracking the call, however it ended; idempotent."""
        self.calls.discard(call)
        episode = call.episode
        if call.staged is not None and episode is not None:
            self._stamps.touch(episode)  # its record loses the cut it may be stored with
        if episode in self._finished_while_busy and not self._busy(episode):
            self._finished_while_busy.discard(episode)
            self._release(episode)
        self.context.changed()

    def episode_finished(self, episode: EpisodeId) -> None:
        """The episode's owner delivered its final reply: drop its ledger (restored or not)
        now, or once its last call still running ends (see the module docstring)."""
        if self._busy(episode):
            self._finished_while_busy.add(episode)
            return
        self._release(episode)
        self.context.changed()

    def _busy(self, episode: EpisodeId | None) -> bool:
        return episode is not None and any(c.episode == episode for c in self.calls)

    def _release(self, episode: EpisodeId) -> None:
        self.ledgers.pop(episode, None)
        self.restored.pop(episode, None)
        self._installed.discard(episode)

    # -- Participant --------------------------------------------------------------------

    def close_admission(self) -> None:
        self._open = False
        self._opened = asyncio.Event()
        self._staging.start(self.backend, self.calls, self.context)
        self.context.changed()

    def open_admission(self) -> None:
        self._staging.stop()
        for call in self.calls:
            if call.staged is not None and call.episode is not None:
                self._stamps.touch(call.episode)  # its record loses the cut
            call.staged = None  # the call goes on and delivers: nothing to continue
        self._open = True
        self._opened.set()
        self.context.changed()

    def set_weight_version(self, version: int) -> int:
        previous, self.weight_version = self.weight_version, version
        return previous

    def counters(self) -> Mapping[str, int]:
        return {"weight_version": self.weight_version}

    def shutting_down_now(self) -> None:
        self._shutting_down = True
        self._staging.stop()
        self._opened.set()  # held responses wake up and are answered 503

    def cut_of(self, episode: EpisodeId) -> GenerationCut | None:
        """The episode's cut for a checkpoint: staged at this close for its undelivered call,
        else a restored one not claimed yet (carried forward, like its ledger)."""
        staged = [c for c in self.calls if c.episode == episode and c.staged is not None]
        if staged:
            return max(staged, key=lambda c: c.sequence).staged
        restored = self.restored.get(episode)
        return restored.cut if restored is not None else None

    def ready(self) -> bool:
        return not self._staging.running and not any(c.streaming for c in self.calls)

    def report(self) -> ReadinessReport:
        blockers = [
            Blocker(
                c.episode.capture_key if c.episode else "",
                BlockerReason.STREAMING_RESPONSE,
                "a response is streaming",
            )
            for c in self.calls
            if c.streaming
        ]
        if self._staging.running:
            blockers.extend(
                Blocker(
                    c.episode.capture_key if c.episode else "",
                    BlockerReason.STAGING_GENERATION_CUTS,
                    "the backend is staging the prefix generated so far",
                )
                for c in self._staging.calls
            )
        held = sum(1 for c in self.calls if c.held)
        cut = sum(1 for c in self.calls if c.staged is not None)
        return ReadinessReport.build(
            blockers,
            {
                "inflight": len(self.calls) - held,
                "held": held,
                "episodes": len(self.ledgers),
                "cut": cut,
            },
        )

    async def export(self, scope: frozenset[EpisodeId] | None) -> Sequence[ExportRecord]:
        changes = await self.export_changes(scope, None)
        return cast(Sequence[ExportRecord], changes.items)

    def change_clock(self) -> int:
        return self._stamps.clock

    async def export_changes(
        self, scope: frozenset[EpisodeId] | None, base: ExportBase | None
    ) -> ChangeSet:
        """The ledger of every episode in scope, those unchanged since the `base` part's cut
        as `UnchangedRecord`s (not decoded, not encoded again).

        Safe for any server behind the middleware: a ledger is this participant's own (rows
        of bytes, appended only by `delivered`), so every change of a record goes through a
        method that stamps it. A record with a generation cut is always exported whole: a cut
        is staged at this checkpoint's close and gone at its resume, so it is never the same
        as what an earlier part holds; the end of a cut is stamped (`open_admission`,
        `call_finished`), so the ledger stored with a cut is never referenced after it."""
        assert scope is not None  # the control plane refuses unscoped commits (requires_scope)
        items: list[ExportRecord | UnchangedRecord] = []
        for episode in sorted(scope):
            if self.context.retired.is_retired(episode):
                continue
            ledger = self._ledger(episode)
            cut = self.cut_of(episode)
            if ledger is None and cut is None:
                continue
            if cut is None and self._stamps.unchanged(episode, episode, base):
                items.append(UnchangedRecord(episode, episode))
                continue
            fields: dict[str, Any] = {"calls": ledger.calls if ledger is not None else []}
            if cut is not None:
                fields["generation_cut"] = cut.to_json()
            items.append(ExportRecord(episode, fields))
        return ChangeSet(items)

    async def install(self, records: Sequence[RestoredRecord]) -> None:
        if self.has_served():
            raise rejected_checkpoint("restore needs a model process that has not served calls")
        restored = {record.restored_as: restored_ledger(record) for record in records}
        self.restored = restored
        self._installed = set(restored)
        for episode in restored:
            self._stamps.touch(episode)
        self.context.changed()

    async def discard_installed(self, episodes: Sequence[EpisodeId]) -> None:
        """Drop the installed ledgers of `episodes` (claimed by a call or not), no marks.

        No call can be running on them: admission stays closed from the install on, and a
        closed model refuses every new call."""
        for episode in set(episodes) & self._installed:
            self.restored.pop(episode, None)
            self.ledgers.pop(episode, None)
            self._installed.discard(episode)
        self.context.changed()

    async def retire(self, episode: EpisodeId) -> None:
        def covered(other: EpisodeId | None) -> bool:
            return (
                other is not None
                and other.rollout_id == episode.rollout_id
                and other.attempt <= episode.attempt
            )

        running = [c for c in self.calls if covered(c.episode)]
        for call in running:
            if call.task is not None and call.task is not asyncio.current_task():
                call.retired = True
                detail = f"attempt {episode.capture_key} was retired"
                cancel_request(call.task, "stale_attempt", detail)
        for tracked in [e for e in self.ledgers if covered(e)]:
            del self.ledgers[tracked]
        for tracked in [e for e in self.restored if covered(e)]:
            del self.restored[tracked]
        self._installed = {e for e in self._installed if not covered(e)}
        self.context.changed()

    def restored_pending(self) -> frozenset[EpisodeId]:
        return frozenset(self.restored)

    def episodes(self) -> Sequence[EpisodeInfo]:
        """Episodes with a call in flight or held (not at a boundary while one streams), and
        restored ledgers no call claimed yet: never a ledger merely kept (see the class)."""
        streaming: dict[EpisodeId, bool] = {}
        for call in self.calls:
            if call.episode is not None:
                streaming[call.episode] = streaming.get(call.episode, False) or call.streaming
        infos = [
            EpisodeInfo(e, at_boundary=not s, oldest_weight_version=self._oldest_version(e))
            for e, s in streaming.items()
        ]
        infos.extend(
            EpisodeInfo(
                e,
                at_boundary=True,
                restored_pending=True,
                oldest_weight_version=ledger.oldest_weight_version,
            )
            for e, ledger in self.restored.items()
            if e not in streaming
        )
        return infos

    def _ledger(self, episode: EpisodeId) -> Ledger | None:
        """The episode's ledger: claimed by a call, or restored and not claimed yet."""
        return self.ledgers.get(episode) or self.restored.get(episode)

    def _oldest_version(self, episode: EpisodeId) -> int | None:
        ledger = self._ledger(episode)
        return None if ledger is None else ledger.oldest_weight_version

    def committed(self, scope: frozenset[EpisodeId] | None) -> None:
        """Release the ledgers the commit's scope leaves out and no call uses now: the
        controller does not continue them. One whose call still runs or is held stays until
        a later commit leaves it out again (its agent may still be running it)."""
        if scope is None:
            return
        busy = {c.episode for c in self.calls}
        for episode in [e for e in self.ledgers if e not in scope and e not in busy]:
            del self.ledgers[episode]
            self._installed.discard(episode)
        self._stamps.prune()

    def forget(self, rollout_ids: Sequence[str]) -> None:
        """The controller is done with these rollouts: their ledgers go too."""
        forgotten = set(rollout_ids)
        for ledgers in (self.ledgers, self.restored):
            for episode in [e for e in ledgers if e.rollout_id in forgotten]:
                del ledgers[episode]
        self._installed = {e for e in self._installed if e.rollout_id not in forgotten}

    def has_served(self) -> bool:
        """A call of an episode started here, or a ledger is held. A call without a rollout
        prefix tracks no episode (nothing of it is ever exported), so like a refused call it
        leaves the process fresh."""
        return self._served or bool(self.ledgers) or bool(self.restored)

    def forget_served(self) -> None:
        """A rejoining restore retired every episode listed: drop the ledgers left (those of
        finished episodes) and the sticky flag. A call of an episode that is still tracked
        and was not cancelled by a retire keeps the process served: its response could still
        enter a ledger beside the restored ones. A cancelled one never delivers."""
        self.ledgers.clear()
        self._served = any(c.episode is not None and not c.retired for c in self.calls)

    def facts(self) -> Mapping[str, str]:
        return {"held_responses": "until_resume"}


class ModelAdmissionMiddleware:
    """Admission, held responses and the delivered-calls ledger around a model app."""

    def __init__(self, app: ASGIApp, participant: ModelParticipant) -> None:
        self.app = app
        self.participant = participant

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == EPISODE_FINISHED_PATH
        ):
            await self._episode_finished(scope, send)
            return
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        participant = self.participant
        episode = episode_of(scope)
        refusal = participant.refusal(episode)
        if refusal is not None:
            await send_refusal(send, 409, *refusal)
            return
        body = await read_body(receive)
        call = participant.call_started(episode, body)
        # The backend keys its generation by the call (to stage its prefix at a cut), and
        # continues a restored cut's prefix attached to a re-issued call.
        scope = dict(scope)
        scope[CALL_KEY] = call
        if call.prefix is not None:
            scope[PREFIX_KEY] = call.prefix
        # A retire cancels the call through `cancel_request`: RequestEndingsMiddleware (the
        # runtime's, outside this one) answers it 409 `stale_attempt` without letting a
        # shutdown's cancellation be swallowed.
        try:
            await self._run(scope, body, receive, send, call)
        finally:
            participant.call_finished(call)

    async def _episode_finished(self, scope: Scope, send: Send) -> None:
        """`EPISODE_FINISHED_PATH`: 204 once the episode's ledger is released. Never refused
        by admission: a release during a checkpoint is as safe as any other (the module
        docstring), and refusing it would only keep the ledger."""
        episode = episode_of(scope)
        if episode is None:
            await send_refusal(
                send,
                400,
                "rollout_prefix_required",
                f"call /ng-rollout/<capture_key>{EPISODE_FINISHED_PATH}",
            )
            return
        self.participant.episode_finished(episode)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _run(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, call: ModelCall
    ) -> None:
        start: Message | None = None
        chunks: list[bytes] = []
        streamed = False
        stream_complete = False

        async def capture(message: Message) -> None:
            nonlocal start, streamed, stream_complete
            if message["type"] == "http.response.start":
                start = message
                headers = dict(message.get("headers", []))
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    streamed = True
                    # A stream that has not started by the close waits like any response.
                    if not await self.participant.hold_until_open(call):
                        raise _ShuttingDown
                    self.participant.streaming_started(call)
                    await send(stamped(message, call))
                return
            if streamed:
                chunks.append(message.get("body", b""))
                await send(message)
                stream_complete = not message.get("more_body", False)
                return
            chunks.append(message.get("body", b""))

        try:
            await self.app(scope, body_then(body, receive), capture)
        except _ShuttingDown:
            await send_refusal(send, 503, "shutting_down", "the server is shutting down; retry")
            return
        if streamed:
            if stream_complete:
                self.participant.delivered(call, b"".join(chunks))
            return
        if start is None:
            return
        # The whole response is here. Deliver it now, or hold it until resume: an undelivered
        # response leaves the agent at the boundary before the call.
        if not await self.participant.hold_until_open(call):
            await send_refusal(send, 503, "shutting_down", "the server is shutting down; retry")
            return
        payload = b"".join(chunks)
        await send(stamped(start, call))
        await send({"type": "http.response.body", "body": payload, "more_body": False})
        self.participant.delivered(call, payload)


def stamped(start: Message, call: ModelCall) -> Message:
    """The reply's start with `WEIGHT_VERSION_HEADER` set to the version the call was
    admitted under (one the app set itself is replaced: the participant's stamp is what
    the ledger records, and the two must agree)."""
    headers = [
        (name, value)
        for name, value in start.get("headers", [])
        if name.lower() != WEIGHT_VERSION_HEADER
    ]
    headers.append((WEIGHT_VERSION_HEADER, str(call.weight_version).encode()))
    return {**start, "headers": headers}


class _ShuttingDown(Exception):
    """Raised into the app when a held stream is never started (the server shuts down)."""


def body_then(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app `body` (already read by a middleware) once, then the real
    channel: an app that listens for the disconnect (a streaming response) must wait on it,
    not spin on empty bodies."""
    replayed = False

    async def receive_body() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_body


async def read_body(receive: Receive) -> bytes:
    """The whole body; `ClientDisconnect` when the caller leaves before sending it all: a
    partial body must never run a generation, let alone enter an episode's ledger."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)
