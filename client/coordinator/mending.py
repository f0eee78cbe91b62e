"""Mending what a dead controller left: every member's state read, and finished or undone.

The coordinator keeps no state. On start the supervisor reads every member's state (GetStatus)
and finishes or undoes whatever it finds: a member started closed (a replacement that came up
while no supervisor ran, or a fresh install) or a member RESTORED under a recovery id (a
supervisor killed between restore and resume, or whose Resume did not reach it) awaits a
recovery, which replays the restore under the same derived id and resumes (`recovery_finished`
is announced then, with the continued rollouts); a member PREPARING, PREPARED or COMMITTED (a
checkpoint cut by the kill) is resumed with its checkpoint's id. Otherwise the fleet would
stay closed until the lease expires (minutes), and a trainer would never learn which rollouts
to re-send. A member that comes back with the same boot id (a pause, a network cut) is read
again the same way: a Resume that could not reach it left it closed. A fresh install has no
`LATEST`, so its members are only opened. No event will ever announce a member left closed:
this read is the only way the supervisor learns of one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from rollout_checkpoint.client.checkpointing.fanout import awaiting_restore
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.client.recovery import RECOVERY_PREFIX
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import types_pb2

log = logging.getLogger(__name__)

IDLE = types_pb2.PARTICIPANT_STATE_IDLE
RESTORED = types_pb2.PARTICIPANT_STATE_RESTORED
CHECK_SECONDS = 5.0
"""The timeout of one GetStatus of a member's state check."""


async def mend(
    spec: FleetSpec,
    names: Collection[str],
    *,
    on_start: bool,
    own_checkpoints: Collection[str],
    resume_seconds: float,
    awaits_recovery: Callable[[str], None],
) -> None:
    """Read the state of the members `names`, tell `awaits_recovery` each member that awaits
    a recovery (the moment it is found: a death of it from then on is a replacement's), and
    end the checkpoints nothing will finish.

    A member that does not answer is skipped (the watch reports it UP again, and it is read
    then). `on_start`: a checkpoint left open under any id was cut by a dead controller;
    later only the supervisor's `own_checkpoints` (an abort that missed a member) are known
    to be over, another live controller's may still be running."""
    members = [m for m in spec.members if m.name in names]
    statuses = await asyncio.gather(*(_status(spec, m) for m in members))
    for member, status in zip(members, statuses, strict=True):
        if status is None:
            continue
        if awaiting_restore(status) or (
            status.state != IDLE and status.checkpoint_id.startswith(RECOVERY_PREFIX)
        ):
            log.info(
                "supervisor: %s awaits a recovery (state %s, id %s)",
                member.name,
                types_pb2.ParticipantState.Name(status.state),
                status.checkpoint_id or "-",
            )
            awaits_recovery(member.name)
        elif status.state not in (IDLE, RESTORED) and (
            on_start or status.checkpoint_id in own_checkpoints
        ):
            await _end_cut_checkpoint(spec, member, status.checkpoint_id, resume_seconds)


async def _status(spec: FleetSpec, member: MemberSpec) -> pb.GetStatusResponse | None:
    async with _client(spec, member) as client:
        try:
            return await client.get_status()
        except ControlError as error:
            log.info("supervisor: reading %s's state failed (%s)", member.name, error)
            return None


def _client(spec: FleetSpec, member: MemberSpec) -> ParticipantClient:
    return spec.client(member, timeout=CHECK_SECONDS, credentials=spec.credentials())


async def _end_cut_checkpoint(
    spec: FleetSpec, member: MemberSpec, checkpoint_id: str, resume_seconds: float
) -> None:
    """Resume a member still inside a checkpoint that nothing will finish: published or
    not, its controller is gone, and the member would stay closed until its lease."""
    log.info("supervisor: ending checkpoint %s left open on %s", checkpoint_id, member.name)
    async with _client(spec, member) as client:
        try:
            await client.resume(checkpoint_id, time.time() + resume_seconds)
        except ControlError as error:
            # It is read again when the watch sees it come back; else its lease reopens it.
            log.warning("supervisor: resuming %s failed (%s)", member.name, error)
