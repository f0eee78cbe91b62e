"""ListEpisodes paging: pages in capture-key order, and opaque tokens that resume after a key.

The token names the last capture key of the page, not an offset: episodes start and end
between two calls, and an offset would then skip or repeat episodes. A token this
participant did not issue is INVALID_REQUEST (never a page of someone else's order), and
the page size is capped so one call cannot ask for an unbounded answer.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable
from typing import TypeVar

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import invalid_request
from rollout_checkpoint.server.runtime.participant import EpisodeInfo

T = TypeVar("T")

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 500


def page_of(
    episodes: Iterable[EpisodeInfo], page_size: int, page_token: str
) -> tuple[list[EpisodeInfo], str]:
    """The page of `episodes` after `page_token` ("" for the first), and the next token ("" at
    the end). `page_size` 0 means the default; a negative size or a foreign token raises
    `CheckpointError(INVALID_REQUEST)`."""
    return page_by_key(
        episodes, lambda e: e.episode_id.capture_key, page_size, page_token, DEFAULT_PAGE_SIZE
    )


def page_by_key(
    items: Iterable[T], key: Callable[[T], str], page_size: int, page_token: str, default: int
) -> tuple[list[T], str]:
    """`page_of` for any items ordered by a capture key (`key`); `default` is the size of a
    page when `page_size` is 0."""
    if page_size < 0:
        raise invalid_request("page_size", "must not be negative")
    size = min(page_size or default, MAX_PAGE_SIZE)
    after = decode_page_token(page_token) if page_token else None
    ordered = sorted(items, key=key)
    if after is not None:
        ordered = [item for item in ordered if key(item) > after]
    page = ordered[:size]
    more = len(ordered) > size
    token = encode_page_token(key(page[-1])) if more and page else ""
    return page, token


def encode_page_token(capture_key: str) -> str:
    return base64.urlsafe_b64encode(capture_key.encode()).decode()


def decode_page_token(token: str) -> str:
    """The capture key a token resumes after; INVALID_REQUEST for anything not issued here."""
    try:
        key = base64.urlsafe_b64decode(token.encode()).decode()
        EpisodeId.from_capture_key(key)
    except (ValueError, binascii.Error, UnicodeError) as exc:
        raise invalid_request("page_token", "not a token this participant issued") from exc
    return key
