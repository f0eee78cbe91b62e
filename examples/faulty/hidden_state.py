"""Planted bug: declared `stateless`, but its count is one number for the whole process.

Its author reasoned "no session holds anything, so there is nothing to checkpoint": the
count is a single process-wide total that every session adds to. A `stateless` server
promises that a reply depends on the request only; this one's depends on every call the
process served before. The same request twice on one fresh process answers two counts, a
replacement after a crash starts again from zero, and the stateless probe of `certify`
(each request replayed alone on a fresh process) finds the replies differ at `$.count`.
"""

from __future__ import annotations

from typing import Any

from rollout_checkpoint.server.resources import CheckpointMode, ResourcesServer, tool

from .honest import IncrementArgs, NoArgs


class HiddenStateCounter(ResourcesServer):
    checkpoint_mode = CheckpointMode.STATELESS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.total = 0  # BUG: state, shared by every session, that no checkpoint carries

    @tool("Add `count` to the counter; answers the new count.")
    async def increment_counter(self, session_id: str, args: IncrementArgs) -> dict[str, Any]:
        self.total += args.count
        return {"count": self.total}

    @tool("Read the counter.")
    async def get_counter_value(self, session_id: str, args: NoArgs) -> dict[str, Any]:
        return {"count": self.total}

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        expected = body.get("expected_count")
        return {"count": self.total, "reward": 1.0 if self.total == expected else 0.0}
