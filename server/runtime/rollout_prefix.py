"""The rollout prefix: `/ng-rollout/<capture_key>/<route>` names the episode of a data call.

A pure ASGI middleware strips the prefix before routing and puts the episode into the scope,
so routes stay as they are and no request body is ever inspected to learn the episode. A call
without the prefix belongs to no episode.
"""

from __future__ import annotations

from functools import lru_cache

from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.refusals_http import send_refusal

PREFIX = "/ng-rollout/"
EPISODE_KEY = "rollout_checkpoint.episode"


def episode_of(scope: Scope) -> EpisodeId | None:
    """The episode a request belongs to, as the prefix named it (None without a prefix)."""
    episode: EpisodeId | None = scope.get(EPISODE_KEY)
    return episode


def rollout_path(episode: EpisodeId, route: str) -> str:
    """The data-plane path of `route` (e.g. `/seed_session`) for `episode`."""
    return f"{PREFIX}{episode.capture_key}/{route.lstrip('/')}"


@lru_cache(maxsize=4096)
def _episode(capture_key: str) -> EpisodeId:
    """The episode of a capture key, parsed (and validated) once per key while it is among
    the 4,096 most recent: a rollout makes many calls under one prefix, and parsing it is a
    regular expression and a validated dataclass each time. Invalid keys raise (never
    cached), so a client sending garbage cannot fill the cache with anything."""
    return EpisodeId.from_capture_key(capture_key)


class RolloutPrefixMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] not in ("http", "websocket") or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        capture_key, slash, rest = path[len(PREFIX) :].partition("/")
        try:
            episode = _episode(capture_key)
        except ValueError as exc:
            await _bad_prefix(scope, send, str(exc))
            return
        route = "/" + rest if slash else "/"
        inner = dict(scope)
        inner["path"] = route
        inner["raw_path"] = route.encode()
        inner[EPISODE_KEY] = episode
        await self.app(inner, receive, send)


async def _bad_prefix(scope: Scope, send: Send, detail: str) -> None:
    if scope["type"] != "http":
        await send({"type": "websocket.close", "code": 1008})
        return
    await send_refusal(send, 400, "invalid_rollout_prefix", detail)
