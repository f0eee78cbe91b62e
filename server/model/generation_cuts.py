"""Generation cuts: a call mid-generation at a checkpoint continues after a restore.

Without cuts, a policy-model call that is still generating when the fleet is cut is lost: its
response is never delivered, the restored agent re-issues the call, and the model generates it
from scratch. With cuts:

1. At the close (Prepare), the model participant asks its inference backend, once, to *stage*
   the prefix generated so far of every undelivered call (`GenerationBackend.stage`). The round
   is bounded by half the Prepare time left, and the participant reports a
   `STAGING_GENERATION_CUTS` blocker meanwhile; a round that fails or times out stages nothing,
   which only costs regeneration (never correctness: a cut is an optimisation of the re-issued
   call, not part of the episode's state).
2. A staged prefix is recorded with the episode (`generation_cut` in the model's record, beside
   its ledger): the conversation's digest, the prefix text and how many tokens it is. At most
   one cut per episode: an episode has at most one call the agent will re-issue (the one after
   its boundary); if several calls of it are undelivered (one was abandoned), only the one
   started last is staged.
3. After a restore, the replacement's first call of the episode claims the ledger. If its
   conversation digest equals the cut's, the prefix is attached to the call (`prefix_of` on the
   ASGI scope) and the backend continues it, generating only the remainder; otherwise the cut
   is dropped (a different conversation must never get someone else's prefix).

The conversation digest is the SHA-256 of the request's `messages` as canonical JSON (sorted
keys, compact separators): the re-issued call rebuilds the same conversation from the agent's
boundary, while transport details (`stream`, the key order of the body) may differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Scope

PREFIX_KEY = "rollout_checkpoint.generation_prefix"
"""The ASGI scope key of the prefix attached to a re-issued call (a `GenerationPrefix`)."""
CALL_KEY = "rollout_checkpoint.model_call"
"""The ASGI scope key of the call's identity, which a backend keys its progress by."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class GenerationPrefix:
    """What a backend generated so far of one call: `text` (backend-defined: the assistant
    content for an OpenAI-compatible server, the scripted model's generation text) and how many
    `tokens` it is. Only a prefix of at least one token is worth staging."""

    text: str
    tokens: int


@dataclass(frozen=True)
class GenerationCut:
    """A staged prefix recorded with its episode: continued only by a call whose conversation
    has this digest."""

    conversation_sha256: str
    prefix: GenerationPrefix

    def to_json(self) -> dict[str, Any]:
        return {
            "conversation_sha256": self.conversation_sha256,
            "text": self.prefix.text,
            "tokens": self.prefix.tokens,
        }

    @classmethod
    def from_json(cls, value: object) -> GenerationCut:
        """A stored cut; ValueError when it is not exactly one."""
        if not isinstance(value, Mapping) or set(value) != {
            "conversation_sha256",
            "text",
            "tokens",
        }:
            raise ValueError("a generation cut holds exactly conversation_sha256, text and tokens")
        digest, text, tokens = value["conversation_sha256"], value["text"], value["tokens"]
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ValueError("a generation cut's conversation_sha256 is 64 lowercase hex digits")
        if not isinstance(text, str) or not text:
            raise ValueError("a generation cut's text is a non-empty string")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ValueError("a generation cut's tokens is a positive integer")
        return cls(digest, GenerationPrefix(text, tokens))


class GenerationBackend(Protocol):
    """The inference backend's side of generation cuts."""

    async def stage(self, calls: Sequence[object]) -> Mapping[object, GenerationPrefix]:
        """The prefix generated so far of each of `calls` (the objects the backend found under
        `CALL_KEY` while generating), for those that have one. One round for all of them; may
        raise, or be cancelled at its time bound: either only costs regeneration. It must not
        disturb the generations themselves (they go on, and are held until resume)."""
        ...


def conversation_digest(body: bytes) -> str | None:
    """The SHA-256 of the request's `messages` as canonical JSON; None for a body that is not a
    JSON object with a list of messages (such a call is never cut)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list):
        return None
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def prefix_of(scope: Scope) -> GenerationPrefix | None:
    """The prefix attached to this call by a restored cut (None: generate from scratch)."""
    prefix: GenerationPrefix | None = scope.get(PREFIX_KEY)
    return prefix


def call_of(scope: Scope) -> object | None:
    """The identity the model participant tracks this call by (None outside the middleware)."""
    return scope.get(CALL_KEY)
