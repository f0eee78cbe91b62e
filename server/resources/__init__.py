"""The resources participant kind: per-episode tool state keyed by a session cookie.

The public surface users import (`from rollout_checkpoint.server.resources import ...`).
"""

from rollout_checkpoint.server.resources.participant import (
    CheckpointMode,
    InvalidSessionState,
    SessionHooks,
    VerifyMode,
)
from rollout_checkpoint.server.resources.server import ResourcesServer, ResourcesServerConfig, tool

__all__ = [
    "CheckpointMode",
    "InvalidSessionState",
    "ResourcesServer",
    "ResourcesServerConfig",
    "SessionHooks",
    "VerifyMode",
    "tool",
]
