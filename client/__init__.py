"""Controllers: the typed participant client, coordination, the coordinator, the CLI.

Imports nothing of `rollout_checkpoint.server` but its core (an import-linter contract in the
tests enforces it). Importing this package loads nothing (not grpc either): `ControlError` and
`ParticipantClient` are resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_checkpoint.client.errors import ControlError
    from rollout_checkpoint.client.participant import ParticipantClient

__all__ = ["ControlError", "ParticipantClient"]


def __getattr__(name: str) -> Any:
    if name == "ControlError":
        from rollout_checkpoint.client.errors import ControlError

        return ControlError
    if name == "ParticipantClient":
        from rollout_checkpoint.client.participant import ParticipantClient

        return ParticipantClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazily resolved names too: what lists a module through dir() (autodoc's API page,
    help(), completion) would otherwise miss every name `__getattr__` resolves."""
    return sorted({*globals(), *__all__})
