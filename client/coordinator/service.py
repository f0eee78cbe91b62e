"""CoordinatorService: the fleet rules behind a few typed RPCs, for controllers in any language.

`rollout-checkpoint coordinator --fleet FILE --grpc-address HOST:PORT` runs it. It keeps no
checkpoint state of its own (the participants do, and replay recorded results), so every
call is safe to retry and the coordinator itself can be restarted at any time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2
from starlette.applications import Starlette

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.checkpointing.checkpoint import (
    CheckpointEvent,
    Phase,
    checkpoint,
    restore_published,
)
from rollout_checkpoint.client.checkpointing.fanout import DERIVE, FleetProgress, MemberProgress
from rollout_checkpoint.client.checkpointing.publication import (
    PublicationError,
    PublicationRoot,
    as_checkpoint_error,
    open_checkpoint_root,
)
from rollout_checkpoint.client.checkpointing.publication.history import Trigger
from rollout_checkpoint.client.checkpointing.recording import finish_records
from rollout_checkpoint.client.coordinator.calls import (
    PREPARE_OUTCOMES,
    SERVICE,
    SERVICE_NAME,
    TracingObserver,
    listed_blockers,
    no_checkpoint_root,
    prepare_outcome,
    root_call,
    status_of,
)
from rollout_checkpoint.client.coordinator.dashboard import dashboard_app
from rollout_checkpoint.client.coordinator.fleet_events import FleetEventLog, member_message
from rollout_checkpoint.client.coordinator.held_fleets import HeldFleets
from rollout_checkpoint.client.coordinator.history_api import CheckpointHistoryApi
from rollout_checkpoint.client.coordinator.http_api import coordinator_app
from rollout_checkpoint.client.coordinator.http_listener import HttpListener
from rollout_checkpoint.client.coordinator.supervisor import Supervisor, SupervisorSettings
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec
from rollout_checkpoint.client.fleet.membership import FleetWatch
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id, rollout_id_problem
from rollout_checkpoint.server.core.errors import (
    CheckpointError,
    Reason,
    invalid_request,
)
from rollout_checkpoint.server.core.extras import REFLECTION, require
from rollout_checkpoint.server.core.rpc import handlers
from rollout_checkpoint.server.core.rpc.auth import BearerTokenInterceptor
from rollout_checkpoint.server.core.rpc.health_listener import (
    HealthListener,
    bind_health_listener,
    stop_with_health,
)
from rollout_checkpoint.server.core.rpc.standard_services import (
    HEALTH_SERVICE,
    REFLECTION_SERVICE,
    ListingHealthServicer,
    health_handler,
    hostile_input_log,
    reflection_handler,
)
from rollout_checkpoint.server.core.rpc.wire import (
    deadline_of,
    duration,
    episode_ids,
    episode_message,
    timestamp,
)
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import participant_service_pb2 as pb

log = logging.getLogger(__name__)

_PHASES = {
    Phase.PREPARE: cpb.CHECKPOINT_PHASE_PREPARE,
    Phase.COMMIT: cpb.CHECKPOINT_PHASE_COMMIT,
    Phase.PUBLISH: cpb.CHECKPOINT_PHASE_PUBLISH,
    Phase.RESUME: cpb.CHECKPOINT_PHASE_RESUME,
    Phase.DONE: cpb.CHECKPOINT_PHASE_DONE,
    Phase.AWAIT_PARTS: cpb.CHECKPOINT_PHASE_AWAIT_PARTS,
}


class CoordinatorServicer:
    def __init__(
        self,
        spec: FleetSpec,
        *,
        max_deadline_seconds: float = 86400.0,
        events: FleetEventLog | None = None,
    ) -> None:
        self.spec = spec
        self.max_deadline_seconds = max_deadline_seconds
        self.events = events or FleetEventLog()
        self.member_watch: FleetWatch | None = None
        """Started by the first WatchFleet of a coordinator that does not supervise (a
        supervisor watches the members itself)."""
        self.history = CheckpointHistoryApi(spec)
        self.fleets = HeldFleets(functools.partial(_discover, spec))
        self.operations_running = 0
        """Checkpoint and Restore RPCs in progress: the dashboard asks no member while one
        runs (`dashboard.fleet_status`), so an open page never lengthens their pause."""

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        self.operations_running += 1
        try:
            yield
        finally:
            self.operations_running -= 1
        """The discovered fleet, discovered again after any transport failure (a member may
        have been replaced behind the same address); each RPC holds it while it runs."""

    async def forget_fleet(self) -> None:
        await self.fleets.forget()

    async def root(self, deadline: float) -> PublicationRoot:
        """The fleet's checkpoint root, opened by `deadline` (a local root is created, which
        blocks on a frozen filesystem: STORAGE_FAILED then, like any store call)."""
        location = self.spec.checkpoint_root
        if location is None:
            raise no_checkpoint_root("")
        return await root_call(deadline, str(location), open_checkpoint_root, location)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Every RPC of coordinator_service.proto, served by the method of its name."""
        return handlers.service(SERVICE, self, TracingObserver(), status_of)

    async def _guard(self, call: Any) -> Any:
        try:
            return await call
        except fanout.FleetError as error:
            if error.reason == Reason.PARTICIPANT_UNREACHABLE or any(
                not e.decided_by_server for e in error.failures.values()
            ):
                await self.forget_fleet()
            raise

    # -- RPCs ---------------------------------------------------------------------------

    async def list_participants(
        self, request: cpb.ListParticipantsRequest
    ) -> cpb.ListParticipantsResponse:
        await self.forget_fleet()
        return await self.known_participants()

    async def known_participants(self) -> cpb.ListParticipantsResponse:
        """The members as this coordinator knows them (discovered on first use, and again
        after a member failed a call), without discovering them afresh as ListParticipants
        does: a dashboard polls it (`GET /fleet`), and discovering a fleet of a thousand
        members every two seconds is a thousand calls each time."""
        async with self.fleets.held() as fleet:
            return cpb.ListParticipantsResponse(members=[member_message(m) for m in fleet.members])

    async def prepare(
        self, request: cpb.CoordinatorServicePrepareRequest
    ) -> AsyncIterator[cpb.CoordinatorServicePrepareResponse]:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        async with self.fleets.held() as fleet:
            async for progress in fanout.prepare(fleet, request.checkpoint_id, deadline):
                yield cpb.CoordinatorServicePrepareResponse(
                    progress=_progress(progress), final=progress.outcome is not None
                )

    async def commit(
        self, request: cpb.CoordinatorServiceCommitRequest
    ) -> cpb.CoordinatorServiceCommitResponse:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        scope = _scope_choice(request)
        async with self.fleets.held() as fleet:
            result = await self._guard(
                fanout.commit(fleet, request.checkpoint_id, deadline, request.checkpoint_dir, scope)
            )
            return cpb.CoordinatorServiceCommitResponse(
                members=[
                    _member_commit(name, reply) for name, reply in _in_order(fleet, result.members)
                ],
                scope=[episode_message(e) for e in sorted(result.scope or ())],
            )

    async def restore(
        self, request: cpb.CoordinatorServiceRestoreRequest
    ) -> cpb.CoordinatorServiceRestoreResponse:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        source = request.source_checkpoint_id or None
        if source is not None and source != "LATEST" and not is_valid_id(source):
            raise invalid_request("source_checkpoint_id", "is not a checkpoint id")
        scope = (
            episode_ids(request.scope.episodes, "scope.episodes")
            if request.HasField("scope")
            else None
        )
        root = await self.root(deadline)
        async with self.fleets.held() as fleet:
            try:
                with self._operation():
                    restored = await self._guard(
                        restore_published(
                            fleet,
                            root,
                            request.checkpoint_id,
                            deadline,
                            source=source,
                            scope=scope,
                            rejoin=request.rejoin,
                            trigger=Trigger.MANUAL,
                        )
                    )
            except PublicationError as error:
                raise as_checkpoint_error(error) from error
            return cpb.CoordinatorServiceRestoreResponse(
                source_checkpoint_id=restored.source_checkpoint_id,
                members=[
                    cpb.MemberRestore(name=name, restored=reply.restored)
                    for name, reply in _in_order(fleet, restored.replies)
                ],
                controller_state=restored.controller_state,
                continued=[episode_message(e) for e in restored.continued],
            )

    async def resume(
        self, request: cpb.CoordinatorServiceResumeRequest
    ) -> cpb.CoordinatorServiceResumeResponse:
        deadline = self._deadline(request, "deadline", allow_past=True)
        _check_id(request.checkpoint_id)
        async with self.fleets.held() as fleet:
            replies = await self._guard(fanout.resume(fleet, request.checkpoint_id, deadline))
            return cpb.CoordinatorServiceResumeResponse(
                idempotent_members=sorted(n for n, r in replies.items() if r.idempotent)
            )

    async def retire(
        self, request: cpb.CoordinatorServiceRetireRequest
    ) -> cpb.CoordinatorServiceRetireResponse:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        episodes = episode_ids(request.episodes, "episodes")
        if not episodes:
            raise invalid_request("episodes", "must name at least one episode")
        async with self.fleets.held() as fleet:
            await self._guard(fanout.retire(fleet, request.checkpoint_id, deadline, episodes))
            return cpb.CoordinatorServiceRetireResponse(retired=[e.capture_key for e in episodes])

    async def forget(
        self, request: cpb.CoordinatorServiceForgetRequest
    ) -> cpb.CoordinatorServiceForgetResponse:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        if not request.rollout_ids:
            raise invalid_request("rollout_ids", "must name at least one rollout")
        for rollout_id in request.rollout_ids:
            problem = rollout_id_problem(rollout_id)
            if problem is not None:
                raise invalid_request("rollout_ids", problem)
        async with self.fleets.held() as fleet:
            await self._guard(
                fanout.forget(fleet, request.checkpoint_id, deadline, list(request.rollout_ids))
            )
            return cpb.CoordinatorServiceForgetResponse(forgotten=sorted(set(request.rollout_ids)))

    async def renew(
        self, request: cpb.CoordinatorServiceRenewRequest
    ) -> cpb.CoordinatorServiceRenewResponse:
        deadline = self._deadline(request, "deadline")
        _check_id(request.checkpoint_id)
        async with self.fleets.held() as fleet:
            earliest = await self._guard(fanout.renew(fleet, request.checkpoint_id, deadline))
            return cpb.CoordinatorServiceRenewResponse(lease_expires_at=timestamp(earliest))

    async def checkpoint(
        self, request: cpb.CheckpointRequest
    ) -> AsyncIterator[cpb.CheckpointResponse]:
        deadline = self._deadline(request, "deadline")
        if request.checkpoint_id:
            _check_id(request.checkpoint_id)
        scope = _scope_choice(request)
        root = await self.root(deadline)
        async with self.fleets.held() as fleet:
            events = checkpoint(
                fleet,
                root,
                deadline,
                checkpoint_id=request.checkpoint_id or None,
                scope=scope,
                controller_state=request.controller_state,
                keep=self.spec.keep,
                keep_closed=request.keep_closed,
                asynchronous=request.asynchronous or self.spec.async_commit,
                trigger=Trigger.MANUAL,
            )
            try:
                with self._operation():
                    async for event in events:
                        yield _checkpoint_response(event)
            except PublicationError as error:
                raise as_checkpoint_error(error) from error

    async def watch_fleet(
        self, request: cpb.WatchFleetRequest
    ) -> AsyncIterator[cpb.WatchFleetResponse]:
        if self.member_watch is None:
            self.member_watch = FleetWatch(self.spec, self.events.member_changed)
            self.member_watch.start()
        async for event in self.events.read(request.after_sequence, live_only=request.live_only):
            yield cpb.WatchFleetResponse(event=event)

    async def list_checkpoints(
        self, request: cpb.ListCheckpointsRequest
    ) -> cpb.ListCheckpointsResponse:
        return await self.history.list_checkpoints(request)

    async def get_checkpoint(self, request: cpb.GetCheckpointRequest) -> cpb.GetCheckpointResponse:
        return await self.history.get_checkpoint(request)

    # -- checks -------------------------------------------------------------------------

    def _deadline(self, request: Any, field: str, *, allow_past: bool = False) -> float:
        deadline = deadline_of(request, field)
        now = time.time()
        if deadline - now > self.max_deadline_seconds:
            raise invalid_request(field, f"lies more than {self.max_deadline_seconds:g} s ahead")
        if not allow_past and deadline <= now:
            raise CheckpointError(
                Reason.CHECKPOINT_DEADLINE_EXCEEDED, "the deadline has already passed"
            )
        return deadline


async def _discover(spec: FleetSpec) -> Fleet:
    from rollout_checkpoint.client.fleet import DiscoveryError

    try:
        return await Fleet.discover(spec)
    except DiscoveryError as error:
        # A member's own refusal (a wrong token) stays a refusal: PARTICIPANT_FAILED with
        # its reason, not PARTICIPANT_UNREACHABLE, which says "retry, it may come back".
        failures = {
            name: error.errors.get(name) or ControlError(grpc.StatusCode.UNAVAILABLE, message)
            for name, message in error.failures.items()
        }
        raise fanout.FleetError("discover", failures) from error


def _check_id(checkpoint_id: str) -> None:
    if not is_valid_id(checkpoint_id):
        raise invalid_request(
            "checkpoint_id", "must be 1-128 characters matching ^[A-Za-z0-9][A-Za-z0-9._-]*$"
        )


def _scope_choice(request: Any) -> list[EpisodeId] | str | None:
    if request.HasField("scope") and request.derive_scope:
        raise invalid_request("scope", "set either scope or derive_scope, not both")
    if request.derive_scope:
        return DERIVE
    if request.HasField("scope"):
        return episode_ids(request.scope.episodes, "scope.episodes")
    return None


def _in_order(fleet: Fleet, replies: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(m.name, replies[m.name]) for m in fleet.members if m.name in replies]


def _member_progress(member: MemberProgress) -> cpb.MemberProgress:
    # The message mirrors coordination's MemberProgress field for field, but for the error
    # (a ControlError there, its google.rpc.Status here).
    fields = {f.name: getattr(member, f.name) for f in dataclasses.fields(member)}
    del fields["error"]
    message = cpb.MemberProgress(**fields)
    if member.error is not None:
        message.error.CopyFrom(status_of(member.error))
    return message


def _progress(progress: FleetProgress) -> cpb.FleetProgress:
    return cpb.FleetProgress(
        stage=progress.stage,
        members=[_member_progress(m) for m in progress.members],
        blockers=listed_blockers(progress),
        blocker_count=progress.blocker_count(),
        sequence=progress.sequence,
        elapsed=duration(progress.elapsed),
        outcome=prepare_outcome(progress.outcome),
    )


def _member_commit(name: str, reply: pb.CommitResponse) -> cpb.MemberCommit:
    return cpb.MemberCommit(
        name=name,
        manifest=reply.manifest,
        manifest_sha256=reply.manifest_sha256,
        exported=reply.exported,
        retired=reply.retired,
    )


def _checkpoint_response(event: CheckpointEvent) -> cpb.CheckpointResponse:
    response = cpb.CheckpointResponse(phase=_PHASES[event.phase], final=event.final)
    if event.progress is not None:
        response.progress.CopyFrom(_progress(event.progress))
    outcome = event.outcome
    if outcome is not None:
        result = response.result
        result.checkpoint_id = outcome.checkpoint_id
        result.prepare_outcome = PREPARE_OUTCOMES[outcome.prepare_outcome]
        result.prepare_duration.CopyFrom(duration(outcome.prepare_seconds))
        result.commit_duration.CopyFrom(duration(outcome.commit_seconds))
        result.publish_duration.CopyFrom(duration(outcome.publish_seconds))
        if outcome.asynchronous:
            result.durable_duration.CopyFrom(duration(outcome.durable_seconds))
        if outcome.resumed_seconds is not None:
            result.resumed_after.CopyFrom(duration(outcome.resumed_seconds))
        if outcome.published is not None:
            result.retention_duration.CopyFrom(duration(outcome.retention_seconds))
        result.record_count = outcome.record_count
        result.bytes = outcome.bytes
        result.continued.extend(episode_message(e) for e in outcome.continued)
        if outcome.published is not None:
            result.published = True
            result.directory = str(outcome.published.directory)
            result.fleet_manifest_sha256 = outcome.published.fleet_manifest_sha256
    return response


# -- serving --------------------------------------------------------------------------------


class Coordinator:
    """The coordinator server: CoordinatorService + health (+ reflection when asked), each
    parsing its own request bytes, so garbage is a typed INVALID_REQUEST, never UNKNOWN.

    With `credentials` (`server_credentials`) its port is TLS, optionally mutual: controllers
    in other pods send the fleet's token with every call, which plaintext would expose. With
    `health_address` a second port, plaintext whatever `credentials` say, serves the same
    health servicer and nothing else, for the kubelet's native `grpc:` probes. With
    `http_address` an HTTP port serves the history API and the fleet as JSON
    (`http_api.coordinator_app`, behind the same token) in the same event loop; with
    `http_tls` it is HTTPS (the coordinator's CLI gives it the gRPC port's certificate)."""

    def __init__(
        self,
        spec: FleetSpec,
        address: str,
        *,
        reflection_enabled: bool = False,
        grace: float = 5.0,
        supervise: SupervisorSettings | None = None,
        credentials: grpc.ServerCredentials | None = None,
        health_address: str | None = None,
        http_address: str | None = None,
        http_tls: ssl.SSLContext | None = None,
    ) -> None:
        if reflection_enabled:  # MissingExtra now, as one line, not once the server starts
            require(REFLECTION, "coordinator --reflection")
        self.events = FleetEventLog()
        self.servicer = CoordinatorServicer(spec, events=self.events)
        self.supervisor = (
            Supervisor(spec, self.events, supervise) if supervise is not None else None
        )
        if self.supervisor is not None:
            # The supervisor's own watch reports member changes; a second one would only
            # double the probes.
            self.servicer.member_watch = self.supervisor.watch
        self.health = ListingHealthServicer()
        self.address = address
        self.reflection_enabled = reflection_enabled
        self.grace = grace
        self.credentials = credentials
        self.health_address = health_address
        self.health_listener: HealthListener | None = None
        self.http_app: Starlette | None = None
        """The HTTP port's app: more routes (static pages) may be mounted on it before
        `start`. The port serves it behind the dashboard's page (`dashboard_app`)."""
        self.http_listener: HttpListener | None = None
        if http_address:
            self.http_app = coordinator_app(self)
            self.http_listener = HttpListener(
                dashboard_app(
                    self.http_app,
                    spec,
                    self.servicer.fleets.held,
                    lambda: self.servicer.operations_running > 0,
                ),
                http_address,
                http_tls,
            )
        self.port: int | None = None
        self._server: aio.Server | None = None

    async def start(self) -> int:
        """Bind and start serving (health SERVING first), then the supervisor; returns the
        bound port (an address ending in `:0` picks a free one)."""
        server = aio.server(
            interceptors=[BearerTokenInterceptor(self.servicer.spec.token)],
            options=[("grpc.so_reuseport", 0)],
        )
        hostile = hostile_input_log()
        handlers = [self.servicer.generic_handler(), health_handler(self.health, hostile)]
        if self.reflection_enabled:
            names = (SERVICE_NAME, HEALTH_SERVICE, REFLECTION_SERVICE)
            handlers.append(reflection_handler(names, hostile))
        server.add_generic_rpc_handlers(handlers)
        if self.credentials is None:
            self.port = server.add_insecure_port(self.address)
        else:
            self.port = server.add_secure_port(self.address, self.credentials)
        self.health_listener = bind_health_listener(self.health, self.health_address, hostile)
        if self.http_listener is not None:
            self.http_listener.bind()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server = server
        if self.health_listener is not None:
            await self.health_listener.start()
        if self.http_listener is not None:
            await self.http_listener.start()
        if self.supervisor is not None:
            await self.supervisor.start()
        return self.port

    async def stop(self) -> None:
        """Stop gracefully: health NOT_SERVING first (so balancers move away), then the
        supervisor and the member watch, then the server within `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        if self.supervisor is not None:
            await self.supervisor.stop()
        elif self.servicer.member_watch is not None:
            await self.servicer.member_watch.close()
        self.events.close()
        if self.http_listener is not None:
            await self.http_listener.stop()
        await stop_with_health(self._server, self.health_listener, self.grace)
        await self.servicer.forget_fleet()
        await finish_records()  # their daemon threads would end with the process

    async def serve_until(self, stopping: asyncio.Event, on_started: Any = None) -> None:
        """Serve until `stopping` is set, then stop gracefully. The caller owns the signals
        (`stop_signals`): a handler installed here would exist only from this point on, and a
        signal before it would end the process another way. Set before the start, the
        coordinator starts and stops without announcing itself."""
        await self.start()
        try:
            if on_started is not None and not stopping.is_set():
                on_started(self)
            await stopping.wait()
        finally:
            await self.stop()
