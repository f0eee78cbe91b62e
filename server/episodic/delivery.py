"""Reply delivery: tell an episode owner when the reply of a request that ran an episode left.

`ReplyDeliveryMiddleware` watches the response of every request under a rollout prefix. When
the request ends it reports the episode's reply as *delivered* if the last body message
(`more_body` false) was handed to the HTTP server and its `send` returned, else as *failed*
(the send raised, the app raised, the request was cancelled, or the client was seen leaving
first). The owner (`EpisodeSteps.delivered`, `delivery_failed`) then releases or keeps the
outcome (outcomes.py says by which rule); for a request that finished no episode the report
changes nothing.

`EpisodeParticipant.data_plane_middleware` offers it and `install_checkpointing` installs it,
innermost: inside the rollout prefix, whose episode it reads, and next to the routes, so the
message it sees last is the route's own reply. An owner nobody tells keeps every outcome
listed until FINISHED_KEPT pushes it out, so no server has to remember to install it.

"Handed to the server" is all an ASGI app can know: uvicorn drops, silently, a send to a
client that already left. Such a reply counts as delivered unless the app saw the client
leave (`http.disconnect`) first; its caller learns of the loss from its own error.
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.rollout_prefix import episode_of


class DeliveryReports(Protocol):
    """Who learns of each reply's fate: the episode owner (`EpisodeParticipant`)."""

    def delivered(self, episode_id: EpisodeId) -> None: ...

    def delivery_failed(self, episode_id: EpisodeId) -> None: ...


class ReplyDeliveryMiddleware:
    """Reports, when a request under a rollout prefix ends, whether its reply was handed to
    the server (the module docstring says what counts)."""

    def __init__(self, app: ASGIApp, reports: DeliveryReports) -> None:
        self.app = app
        self.reports = reports

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        episode = episode_of(scope) if scope["type"] == "http" else None
        if episode is None:
            await self.app(scope, receive, send)
            return
        reply = _ReplyProgress(receive, send)
        try:
            await self.app(scope, reply.receive, reply.send)
        finally:
            if reply.delivered:
                self.reports.delivered(episode)
            else:
                self.reports.delivery_failed(episode)


class _ReplyProgress:
    """Follows one request's messages: whether its reply's last body was handed over."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.client_left = False
        self.delivered = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect" and not self.delivered:
            self.client_left = True
        return message

    async def send(self, message: Message) -> None:
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        await self._send(message)
        if last and not self.client_left:
            self.delivered = True
