"""The control plane's typed refusals, and the one way a participant hook is called.

Every refusal a controller can act on carries its reason and the ids it concerns:

* STALE_CHECKPOINT: the id was already resumed. A controller that retries a lost reply
  after a Resume must learn that the checkpoint is gone, not redo it under a reopened fleet.
* CHECKPOINT_CONFLICT: another checkpoint (or the same id with other arguments) is active;
  the active id is named so the controller can resume it.
* HOOK_FAILED: a server hook raised something that is not a `CheckpointError`. The hook's
  own exception is logged here once, with its traceback, and the controller gets a typed
  error naming the hook instead of an INTERNAL with the server's internals in it. A
  cancellation is never turned into a refusal: it belongs to whoever cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from rollout_checkpoint.server.core.errors import CheckpointError, Reason

log = logging.getLogger(__name__)

T = TypeVar("T")


def stale(checkpoint_id: str) -> CheckpointError:
    return CheckpointError(
        Reason.STALE_CHECKPOINT,
        f"checkpoint {checkpoint_id} was already resumed",
        metadata={"checkpointId": checkpoint_id},
    )


def conflict(checkpoint_id: str, active: str | None, message: str) -> CheckpointError:
    metadata = {"checkpointId": checkpoint_id}
    if active is not None:
        metadata["activeCheckpointId"] = active
    return CheckpointError(Reason.CHECKPOINT_CONFLICT, message, metadata=metadata)


def hook_failed(hook: str, exc: BaseException) -> CheckpointError:
    """Log the hook's failure (once, with its traceback) and return the typed refusal."""
    log.error("participant hook %s failed: %s", hook, type(exc).__name__, exc_info=exc)
    return CheckpointError(
        Reason.HOOK_FAILED,
        f"the server's {hook} hook raised {type(exc).__name__}",
        metadata={"hook": hook},
    )


async def call_hook(hook: str, call: Awaitable[T]) -> T:
    """Await a participant hook: its `CheckpointError` and a cancellation pass through
    unchanged, any other exception becomes HOOK_FAILED."""
    try:
        return await call
    except (CheckpointError, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise hook_failed(hook, exc) from exc
