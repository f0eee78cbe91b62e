"""Record and replay of the policy model's replies (`--record FILE`, `--replay FILE`).

Rollouts sampled from a real model are not reproducible (temperature 1, batching), so a run
compared with a baseline would differ on every rollout for reasons that have nothing to do
with the servers under test. A recording makes the model reproducible: the baseline runs with
`--record`, and every later run with `--replay` gets, for each call, exactly the reply the
baseline got (status, content type and body, byte for byte, streamed or not), whether the
policy model scripts its replies or proxies a real server.

A call is keyed by its rollout (the rollout prefix's rollout id, else `metadata.rollout_id`,
else `"anonymous"`: never the attempt, so attempt 2 of a restored rollout replays attempt 1's
answers) and the digest of what it asks: the path and the whole request body in canonical
JSON (messages, tools, sampling parameters, `stream`: every field may change the answer, so
none is left out, and a field this module does not know can only cause a miss, never a wrong
answer). In replay a call the baseline never made is itself the finding (the server under test
made the agent ask something new): it gets 409 `not_in_recording` naming the rollout and the
digest, is logged, and is counted at `GET /recording/stats`; it is never generated.

The recording is a JSON-lines file, one reply a line, appended durably (group-committed and
fsynced in a worker thread, never on the event loop) *before* the reply reaches the caller:
a reply a caller saw is in the recording even if the process is killed right after. A torn
last line (a crash mid-append) is cut when recording resumes and ignored on replay. A key is
recorded once: in record mode a call already recorded is answered from the recording (the
first answer wins), so a rollout restored during the baseline continues as replay will.
Replies of status 500 and above (an upstream that failed, a shutdown) are not recorded:
they are transient, and replaying one would fail the call again for no reason.

The middleware runs inside the model participant's admission middleware: admission, held
responses and the ledger of delivered calls see a replayed reply as any other, so checkpoint
and restore work unchanged in both modes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.client.collect.errors import CorruptFile, OutputFailed
from rollout_checkpoint.client.collect.journal import DurableAppender, parse_jsonl, read_jsonl
from rollout_checkpoint.server.model.participant import GENERATION_PATHS, body_then, read_body
from rollout_checkpoint.server.runtime.rollout_prefix import episode_of

from .config import InputFileError
from .policy import ANONYMOUS
from .replies import error_reply

log = logging.getLogger(__name__)

Mode = Literal["record", "replay"]
NOT_IN_RECORDING = "not_in_recording"
"""The reason of the reply to a call the recording does not hold (409)."""
STATS_PATH = "/recording/stats"
"""`GET`: the recording's counts and the calls it did not hold (`RecordingStats`)."""
TRANSIENT_STATUS = 500
"""Replies of this status and above are not recorded (the module docstring says why)."""


def rollout_of(scope: Scope, body: Mapping[str, Any] | None) -> str:
    """The rollout a call belongs to: the rollout prefix's rollout id (any attempt), else the
    body's `metadata.rollout_id`, else `"anonymous"`."""
    episode = episode_of(scope)
    if episode is not None:
        return episode.rollout_id
    metadata = body.get("metadata") if body is not None else None
    named = metadata.get("rollout_id") if isinstance(metadata, Mapping) else None
    return named if isinstance(named, str) and named else ANONYMOUS


def call_digest(path: str, body: bytes) -> str:
    """The SHA-256 of the path and the request body (a JSON object in canonical form: sorted
    keys, compact, ASCII; any other body as its bytes), so a re-issued call whose body was
    serialized in another key order is the same call."""
    return _digest(path, body, _parsed(body))


def call_key(scope: Scope, body: bytes) -> tuple[str, str]:
    """A call's key in the recording: (rollout id, digest), the body parsed once. CPU-bound
    on a long conversation (parse, canonical dump, hash): run it in a thread."""
    request = _parsed(body)
    rollout_id = rollout_of(scope, request if isinstance(request, dict) else None)
    return rollout_id, _digest(scope["path"], body, request)


def _parsed(body: bytes) -> object:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _digest(path: str, body: bytes, request: object) -> str:
    material = (
        json.dumps(request, sort_keys=True, separators=(",", ":")).encode()
        if isinstance(request, dict)
        else body
    )
    return hashlib.sha256(path.encode() + b"\n" + material).hexdigest()


@dataclass(frozen=True)
class RecordedReply:
    """One reply as the caller got it."""

    status: int
    content_type: str
    body: bytes

    def line(self, rollout_id: str, digest: str, path: str) -> bytes:
        """The recording's line: the body as text when it is UTF-8 (what every JSON or
        event-stream reply is), else as base64. ASCII JSON: a rollout id with a lone
        surrogate (`metadata.rollout_id` is the caller's) is escaped, not a failed write."""
        entry: dict[str, Any] = {
            "rollout_id": rollout_id,
            "digest": digest,
            "path": path,
            "status": self.status,
            "content_type": self.content_type,
        }
        try:
            entry["body"] = self.body.decode("utf-8")
        except UnicodeDecodeError:
            entry["body_base64"] = base64.b64encode(self.body).decode()
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def of_line(cls, entry: Mapping[str, Any]) -> tuple[tuple[str, str], RecordedReply]:
        """The key and reply of a recording's line; ValueError naming what is wrong."""
        rollout_id, digest = entry.get("rollout_id"), entry.get("digest")
        status, content_type = entry.get("status"), entry.get("content_type")
        if not isinstance(rollout_id, str) or not isinstance(digest, str):
            raise ValueError("a recorded reply needs a rollout_id and a digest (strings)")
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise ValueError("a recorded reply's status is an HTTP status")
        if not isinstance(content_type, str):
            raise ValueError("a recorded reply's content_type is a string")
        text, encoded = entry.get("body"), entry.get("body_base64")
        if isinstance(text, str) and encoded is None:
            body = text.encode("utf-8")
        elif isinstance(encoded, str) and text is None:
            body = base64.b64decode(encoded, validate=True)
        else:
            raise ValueError("a recorded reply holds exactly one of body and body_base64")
        return (rollout_id, digest), cls(status, content_type, body)


@dataclass
class RecordingStats:
    """What a recording did in this process (`GET /recording/stats`)."""

    recorded: int = 0
    """Replies appended to the recording."""
    replayed: int = 0
    """Calls answered from the recording."""
    misses: dict[tuple[str, str], str] = field(default_factory=dict)
    """The calls the recording did not hold in replay (rollout id, digest) -> path, once
    each: the findings."""
    not_in_recording: int = 0
    """How many calls were refused `not_in_recording` (a call re-issued counts again)."""


class Recording:
    """The replies of a recording file, and its appender in record mode."""

    def __init__(self, path: Path, mode: Mode, replies: dict[tuple[str, str], RecordedReply]):
        self.path = path
        self.mode = mode
        self.replies = replies
        self.stats = RecordingStats()
        self._appender: DurableAppender | None = None

    @classmethod
    def load(cls, path: Path, mode: Mode) -> Recording:
        """The recording at `path` (blocking: call it before the event loop runs, or in a
        thread). Replay needs the file and never writes it; record creates it, or continues
        one (a torn last line cut first, so the next append starts a line of its own).
        `InputFileError` (one line, naming the file and line) for anything unusable."""
        try:
            if mode == "record":
                path.touch()
                entries, _ = read_jsonl(path, "recording")
            else:
                entries, _ = parse_jsonl(path.read_bytes(), path, "recording")
        except OSError as error:
            raise InputFileError(
                f"cannot open the recording {path}: {error.strerror or error}"
            ) from None
        except CorruptFile as error:
            raise InputFileError(str(error)) from None
        replies: dict[tuple[str, str], RecordedReply] = {}
        for number, entry in enumerate(entries, 1):
            try:
                key, reply = RecordedReply.of_line(entry)
            except ValueError as error:
                raise InputFileError(f"{path}:{number}: {error}") from None
            replies.setdefault(key, reply)
        return cls(path, mode, replies)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The appender for the app's lifetime (record mode): every append queued before the
        app stops is written before it closes."""
        if self.mode != "record":
            yield
            return
        appender = DurableAppender(self.path)
        await appender.open()
        self._appender = appender
        try:
            yield
        finally:
            self._appender = None
            await appender.close()

    async def record(self, rollout_id: str, digest: str, path: str, reply: RecordedReply) -> None:
        """Append `reply` durably under its key (a key recorded meanwhile by a concurrent call
        keeps its first reply); `OutputFailed` when it cannot be written."""
        if (rollout_id, digest) in self.replies:
            return
        if self._appender is None:
            raise OutputFailed(f"the recording {self.path} is not open")
        line = await asyncio.to_thread(reply.line, rollout_id, digest, path)
        await self._appender.append(line)
        self.replies.setdefault((rollout_id, digest), reply)
        self.stats.recorded += 1

    def missed(self, rollout_id: str, digest: str, path: str) -> Response:
        """The finding: 409 `not_in_recording`, logged and counted."""
        self.stats.not_in_recording += 1
        self.stats.misses.setdefault((rollout_id, digest), path)
        log.warning(
            "%s rollout_id=%r digest=%s path=%s", NOT_IN_RECORDING, rollout_id, digest, path
        )
        detail = (
            f"the recording {self.path.name} holds no reply to this call of rollout "
            f"{rollout_id} (digest {digest}): the baseline never asked it"
        )
        error = {"code": NOT_IN_RECORDING, "detail": detail, "rollout_id": rollout_id}
        return _ascii_json({"error": {**error, "digest": digest}}, 409)

    def stats_reply(self) -> Response:
        stats = self.stats
        body = {
            "mode": self.mode,
            "recording": str(self.path),
            "replies": len(self.replies),
            "recorded": stats.recorded,
            "replayed": stats.replayed,
            "not_in_recording": stats.not_in_recording,
            "misses": [
                {"rollout_id": rollout_id, "digest": digest, "path": path}
                for (rollout_id, digest), path in stats.misses.items()
            ],
        }
        return _ascii_json(body)


def _ascii_json(body: object, status: int = 200) -> Response:
    """A JSON reply in ASCII: the rollout id it names is the caller's `metadata.rollout_id`,
    which may hold a lone surrogate that UTF-8 cannot encode."""
    return Response(json.dumps(body, separators=(",", ":")), status, media_type="application/json")


class RecordingMiddleware:
    """Answers generation calls from the recording, or records the app's replies (the module
    docstring states the rules). Innermost: inside the model participant's middleware."""

    def __init__(self, app: ASGIApp, recording: Recording, replay_latency: float = 0.0) -> None:
        self.app = app
        self.recording = recording
        self.replay_latency = replay_latency
        """Seconds each answer from the recording waits (`--replay-latency`): it stands for
        the generation the recording saves, so that replayed rollouts take time."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == STATS_PATH:
            await self.recording.stats_reply()(scope, receive, send)
            return
        if scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        rollout_id, digest = await asyncio.to_thread(call_key, scope, body)
        recording = self.recording
        recorded = recording.replies.get((rollout_id, digest))
        if recorded is not None:
            if self.replay_latency and recording.mode == "replay":
                await asyncio.sleep(self.replay_latency)
            recording.stats.replayed += 1
            reply = Response(recorded.body, recorded.status, media_type=recorded.content_type)
            await reply(scope, receive, send)
            return
        if recording.mode == "replay":
            await recording.missed(rollout_id, digest, scope["path"])(scope, receive, send)
            return
        call = _RecordedCall(recording, rollout_id, digest, scope["path"], send)
        await self.app(scope, body_then(body, receive), call.send)
        await call.finish(scope, receive)


class _RecordedCall:
    """One call in record mode: the app's reply, passed on once it is durable.

    A streamed reply (`text/event-stream`) goes through as it is generated, but its end is held
    until the reply is recorded; a reply that cannot be recorded is never finished (the caller
    sees a stream cut short, as after a crash). Any other reply is held whole, then sent, or
    replaced by 503 `recording_failed`: a reply the recording does not hold must not reach the
    caller, or a replay of this run would miss a call its baseline made."""

    def __init__(
        self, recording: Recording, rollout_id: str, digest: str, path: str, send: Send
    ) -> None:
        self.recording = recording
        self.key = (rollout_id, digest, path)
        self._send = send
        self.start: Message | None = None
        self.streamed = False
        self.chunks: list[bytes] = []
        self.ended: Message | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            headers = dict(message.get("headers", []))
            self.streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if self.streamed:
                await self._send(message)
            return
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            if self.streamed:
                await self._send(message)
            return
        self.ended = message

    async def finish(self, scope: Scope, receive: Receive) -> None:
        """Record the reply that ended, then deliver it (or its end)."""
        if self.start is None or self.ended is None:
            return  # the app did not answer (cancelled, or the server stops): nothing to keep
        status = int(self.start["status"])
        headers = dict(self.start.get("headers", []))
        body = b"".join(self.chunks)
        if status < TRANSIENT_STATUS:
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            reply = RecordedReply(status, content_type, body)
            try:
                await self.recording.record(*self.key, reply)
            except OutputFailed as error:
                log.error("recording_failed rollout_id=%s: %s", self.key[0], error)
                if self.streamed:
                    raise
                failed = error_reply(503, "recording_failed", str(error))
                await failed(scope, receive, self._send)
                return
        if self.streamed:
            await self._send(self.ended)
            return
        await self._send(self.start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
