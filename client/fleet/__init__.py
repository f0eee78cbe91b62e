"""The fleet: its file (`spec`), its members found live (`discovery`), who is in it right now
(`membership`), its members started from their commands (`launch`), and ports a member can be
restarted on (`ports`).

The fleet file's model and the discovered fleet are imported together so often (every
controller reads a file, then discovers it) that this package hands their names on: `from
rollout_checkpoint.client.fleet import Fleet, FleetSpec` is the one import a script needs.
`membership` (the `FleetWatch` a supervisor runs) is imported on its own: it is the only part
that watches health streams; so is `launch` (starting members from their fleet-file commands),
the only part that starts processes.
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
