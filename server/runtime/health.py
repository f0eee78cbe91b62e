"""grpc.health.v1 names of a participant, kept in step with its control plane.

    ""  and  rollout_checkpoint.v1.ParticipantService   control RPCs work
    participant-liveness                                  the loop answers and the server is up
    participant-readiness                                 new HTTP traffic may come here

Liveness never depends on a checkpoint: a kubelet that restarted a pod for a closed admission
would destroy exactly the state the checkpoint is for. Readiness drops only for a long pause,
while RESTORED, before a `start_closed` process is resumed, and when shutting down.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpc_health.v1 import health_pb2

from rollout_checkpoint.server.core.rpc.standard_services import ListingHealthServicer
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.waiting import cancel_and_wait

LIVENESS = "participant-liveness"
READINESS = "participant-readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ParticipantHealth:
    def __init__(self, control: ControlPlane, service_names: tuple[str, ...]) -> None:
        self.servicer = ListingHealthServicer()
        self._control = control
        self._control_names = ("", *service_names)
        self._readiness: bool | None = None
        self._flip_at: float | None = None
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._shutting_down = False

    async def start(self) -> None:
        """Register every name before the server takes calls, then follow the control plane."""
        for name in self._control_names:
            await self.servicer.set(name, SERVING)
        await self.servicer.set(LIVENESS, SERVING)
        await self._publish_readiness()
        self._control.add_state_listener(self._on_change)
        self._control.add_fatal_listener(self._on_fatal)
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def mark_unrecoverable(self) -> None:
        await self.servicer.set(LIVENESS, NOT_SERVING)

    def _on_fatal(self, error: BaseException) -> None:
        self._fatal = asyncio.get_running_loop().create_task(self.mark_unrecoverable())

    async def shutdown(self) -> None:
        """Every name NOT_SERVING at once, before any connection drains."""
        self._shutting_down = True
        if self._task is not None:
            await cancel_and_wait(self._task)
        await self.servicer.enter_graceful_shutdown()

    def _on_change(self) -> None:
        """Wake the follower only when readiness, or the moment it flips, would change.

        Readiness depends only on state, admission and shutdown, so this listens to the
        control state alone (not to the data plane's two changes per request), and a
        transition that leaves readiness as it was does not wake the follower either."""
        control = self._control
        if (control.readiness_serving(), control.readiness_changes_at()) != (
            self._readiness,
            self._flip_at,
        ):
            self._dirty.set()

    async def _follow(self) -> None:
        clock = self._control.clock
        while not self._shutting_down:
            self._dirty.clear()
            await self._publish_readiness()
            flip_at = self._flip_at = self._control.readiness_changes_at()
            waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._dirty.wait())]
            if flip_at is not None and self._readiness:
                waits.append(asyncio.ensure_future(clock.sleep_until(flip_at)))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()

    async def _publish_readiness(self) -> None:
        serving = self._control.readiness_serving()
        if serving != self._readiness:
            self._readiness = serving
            await self.servicer.set(READINESS, SERVING if serving else NOT_SERVING)
