"""Controllers: the typed participant client, coordination, and the `rollout-checkpoint` CLI.

Never imports the participant runtime, except its one leaf of value types
(`rollout_checkpoint.server.episodes`).
"""

from .errors import ControlError
from .participant import ParticipantClient

__all__ = ["ControlError", "ParticipantClient"]
