"""What a rollout's `/run` reply means: collected, never started, or failed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

OutcomeKind = Literal["ok", "not_started", "failed"]


@dataclass
class Outcome:
    """A classified `/run` reply.

    `ok` carries the reply (it goes into the output); `not_started` means the entry point
    refused before the episode began (admission closed: nothing ran anywhere, so the same
    attempt may be sent again); `failed` carries the error (the attempt is retired before
    it is retried)."""

    kind: OutcomeKind
    reply: dict[str, Any] | None = None
    error: str | None = None


def classify(response: httpx.Response) -> Outcome:
    """Classify one `/run` reply; never raises (a body that is not JSON is a failure).

    Only a 200 with a JSON object is a result: an entry point passes a failed run on as a
    failure status (the example environment answers its agent's, with the agent's typed
    error). A 200 whose body still carries an `error` object is a failure too, whatever
    served it: recorded as a result, a failed rollout would never be retried."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if response.status_code == 200 and isinstance(body, dict) and error is None:
        return Outcome("ok", reply=body)
    code = error.get("code") if isinstance(error, dict) else None
    if (response.status_code == 409 and code in ("admission_closed", "awaiting_restore")) or (
        response.status_code == 429 and code == "outbox_full"
    ):
        # Refused before the episode began (a checkpoint in progress, a start_closed
        # process waiting for its Restore or Resume, or an entry whose outbox of results
        # waits for acknowledgements): nothing ran anywhere.
        return Outcome("not_started")
    detail = json.dumps(error) if error is not None else response.text[:300]
    return Outcome("failed", error=f"HTTP {response.status_code}: {detail}")


def transport_failure(error: httpx.HTTPError) -> Outcome:
    """A `/run` that got no reply at all (connection refused, timeout, reset): failed."""
    return Outcome("failed", error=f"{type(error).__name__}: {error}")
