"""The admission middleware of a resources server (pure ASGI, inside the session middleware).

Per request, in this order, each rule for the loss it prevents:

1. An MCP call or a `/close_session` during a checkpoint *waits* for resume instead of being
   refused: MCP harnesses hand refusals to the model as tool errors, and a close comes once
   from an episode that already ended, so a refusal would lose the release for good. A waiting
   request is not in flight and never holds up prepare.
2. A request of a retired attempt (by its session or its prefix) is refused `stale_attempt`,
   so a late call cannot recreate state that nothing would free. `/close_session` is never
   refused for this: closing is how a server frees a session.
3. A request whose rollout prefix names another episode than its session's is refused
   `episode_mismatch` (checked after `stale_attempt`, so a retired attempt still answers
   that). A session belongs to one episode for its whole life: a re-bind would untrack the
   episode it served, whose state then silently leaves every later checkpoint, and any
   tracked cookie could act under a made-up rollout. The request never runs, so it never
   re-binds the session and never touches its state (a close included).
4. A `start_closed` process before its controller's Restore or Resume refuses everything,
   even a replay-safe seed, `awaiting_restore`: a process that served cannot restore
   (FRESH_PROCESS_REQUIRED). Its own code, not `admission_closed`, because no checkpoint is in
   progress: the process waits for its controller.
5. With admission closed, anything that is not replay-safe is refused `admission_closed`.
   `/seed_session` (and `/verify` under `replay`) is admitted: the checkpoint does not wait
   for it, and a session first seeded now is neither a blocker nor exported by this
   checkpoint. A seed of a session already tracked is a retry: the session keeps its episode,
   its export and its blocker status.
6. Everything else admitted counts as in flight for its whole duration; the decrement is
   synchronous in a `finally`, so no cancellation can leave a request counted.

Refusals are HTTP 409 `{"error": {"code": "stale_attempt" | "episode_mismatch" |
"awaiting_restore" | "admission_closed", "detail": ...}}` (503 `shutting_down` for a waiting
request whose server stops). Every 409 is counted by code in
`rollout_checkpoint_refusals_total{plane="data"}`.

The session of a request is its cookie's; for an MCP call, the session its signed token names
(a missing or bad token names none, and the MCP endpoint rejects the call), because that is
the session the tool runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources.participant import ResourcesParticipant, VerifyMode
from rollout_checkpoint.server.runtime.refusals_http import send_refusal
from rollout_checkpoint.server.runtime.rollout_prefix import EPISODE_KEY

VERIFY_HEADER = b"x-ng-checkpoint-verify"
SESSION_KEY = "rollout_checkpoint.session_id"
"""The key of the session id inside the signed cookie session (`scope["session"]`)."""

SessionResolver = Callable[[Scope], str | None]

SEED_PATH = "/seed_session"
CLOSE_PATH = "/close_session"
VERIFY_PATH = "/verify"
_LIFECYCLE_PATHS = frozenset({SEED_PATH, CLOSE_PATH, VERIFY_PATH})
"""The routes whose reply changes their session's tracking (the others are only counted)."""
_UNGUARDED_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def cookie_session_id(scope: Scope, key: str = SESSION_KEY) -> str | None:
    """The session id in the request's signed cookie (None: no session middleware ran, no
    cookie, or no session in it). Read from `scope`, so it also sees the id a route just put
    into the cookie (after `/seed_session`). `key`: where in the cookie session the id is
    (ours, or another framework's, e.g. NeMo Gym's `SESSION_ID_KEY`)."""
    session = scope.get("session")
    if not isinstance(session, dict):
        return None
    value = session.get(key)
    return value if isinstance(value, str) else None


class ResourcesAdmissionMiddleware:
    """The per-request admission rules of a resources server (the module docstring lists
    them, each with the loss it prevents), reporting every admitted request to the
    participant. Installed by `ResourcesServer.build_app` inside the session middleware, so
    the cookie is decoded when it runs; `passthrough_paths` are never counted nor refused;
    `session_key` is where the cookie session holds the session id."""

    def __init__(
        self,
        app: ASGIApp,
        participant: ResourcesParticipant,
        *,
        mcp_path: str | None = None,
        mcp_session: SessionResolver | None = None,
        passthrough_paths: Collection[str] = (),
        session_key: str = SESSION_KEY,
    ) -> None:
        self.app = app
        self.session_key = session_key
        self.participant = participant
        self.mcp_path = mcp_path
        self.mcp_session = mcp_session
        self._mcp_below = (mcp_path or "") + "/"
        self.passthrough_paths = frozenset(passthrough_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _UNGUARDED_METHODS:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in self.passthrough_paths:
            await self.app(scope, receive, send)
            return
        is_mcp = self.mcp_path is not None and (
            path == self.mcp_path or path.startswith(self._mcp_below)
        )
        if is_mcp or path in _LIFECYCLE_PATHS:
            await self._guarded_call(scope, receive, send, path, is_mcp)
            return
        # An ordinary call (a tool): the rules but for the waits and the lifecycle routes'
        # exceptions, then counted in flight and nothing else; its reply is none of this
        # middleware's business, so `send` goes through unwrapped. Kept this short on
        # purpose: every request of the data plane runs it.
        participant = self.participant
        session_id = cookie_session_id(scope, self.session_key)
        refusal = participant.refusal(session_id, scope.get(EPISODE_KEY))
        if refusal is not None:
            await send_refusal(send, 409, *refusal)
            return
        in_flight = participant.request_started(session_id)
        try:
            await self.app(scope, receive, send)
        finally:
            participant.request_finished(in_flight)

    async def _guarded_call(
        self, scope: Scope, receive: Receive, send: Send, path: str, is_mcp: bool
    ) -> None:
        """An MCP call, a seed, a close or a verify: the rules with their waits and
        exceptions (the module docstring's 1 to 5)."""
        participant = self.participant
        is_close = path == CLOSE_PATH
        episode: EpisodeId | None = scope.get(EPISODE_KEY)
        if is_mcp:
            session_id = self.mcp_session(scope) if self.mcp_session is not None else None
        else:
            session_id = cookie_session_id(scope, self.session_key)
        if (is_mcp or is_close) and not await participant.wait_for_admission():
            await send_refusal(
                send, 503, "shutting_down", "the server is shutting down; retry", retry_after=1
            )
            return
        replay_safe = path == SEED_PATH or (
            path == VERIFY_PATH and participant.verify is VerifyMode.REPLAY
        )
        refusal = participant.refusal(session_id, episode, close=is_close, replay_safe=replay_safe)
        if refusal is not None:
            await send_refusal(send, 409, *refusal)
            return
        if path not in _LIFECYCLE_PATHS:  # MCP: counted in flight, like a tool call
            in_flight = participant.request_started(session_id)
            try:
                await self.app(scope, receive, send)
            finally:
                participant.request_finished(in_flight)
            return
        await self._lifecycle_call(
            scope, receive, send, path, episode, session_id, replay_safe=replay_safe
        )

    async def _lifecycle_call(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        episode: EpisodeId | None,
        session_id: str | None,
        *,
        replay_safe: bool,
    ) -> None:
        """An admitted seed, close or verify: what it did to its session depends on its
        reply's status (and a seed's reply tells the client the verify mode)."""
        participant = self.participant
        is_seed = path == SEED_PATH
        status = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if is_seed:
                    headers = [
                        *message.get("headers", []),
                        (VERIFY_HEADER, participant.verify.value.encode()),
                    ]
                    message = {**message, "headers": headers}
            await send(message)

        counted = not replay_safe
        in_flight = None
        if is_seed:
            participant.seed_started(episode, session_id)
        elif counted:
            in_flight = participant.request_started(session_id)
        else:
            participant.claim(session_id)
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            succeeded = 200 <= status < 300
            if is_seed:
                session_after = cookie_session_id(scope, self.session_key)
                participant.seed_finished(
                    episode,
                    session_id,
                    session_after,
                    succeeded=succeeded,
                )
            else:
                if counted:
                    participant.request_finished(in_flight)
                else:  # a replay verify ran uncounted: its end is a change all the same
                    participant.touch(session_id)
                if succeeded:  # a close, or a verify
                    deferred = replay_safe and not participant.admission_open
                    participant.session_ended(session_id, deferred=deferred)
