"""The fleet: its file (`spec`), its members found live (`discovery`), who is in it right now
(`membership`).

The fleet file's model and the discovered fleet are imported together so often (every
controller reads a file, then discovers it) that this package hands their names on: `from
rollout_checkpoint.client.fleet import Fleet, FleetSpec` is the one import a script needs.
`membership` (the `FleetWatch` a supervisor runs) is imported on its own: it is the only part
that watches health streams.
"""

from __future__ import annotations

from rollout_checkpoint.client.fleet.discovery import (
    KIND_NAMES,
    STAGE_ORDER,
    DiscoveryError,
    Fleet,
    Kind,
    Member,
)
from rollout_checkpoint.client.fleet.spec import (
    DEFAULT_FAN_OUT,
    FleetConfigError,
    FleetSpec,
    MemberSpec,
    load_fleet_file,
)

__all__ = [
    "DEFAULT_FAN_OUT",
    "KIND_NAMES",
    "STAGE_ORDER",
    "DiscoveryError",
    "Fleet",
    "FleetConfigError",
    "FleetSpec",
    "Kind",
    "Member",
    "MemberSpec",
    "load_fleet_file",
]
