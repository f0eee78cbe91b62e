"""A typed async client for one participant's ParticipantService."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.receipts import Receipt
from rollout_checkpoint.server.core.rpc.tracing import context_metadata
from rollout_checkpoint.server.core.rpc.wire import episode_message, scope_message, timestamp
from rollout_checkpoint.v1 import constants_pb2, types_pb2
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc

T = TypeVar("T")

STATE_PREFIX = "PARTICIPANT_STATE_"


def state_name(state: int, unknown: str) -> str:
    """A participant state's name in types.proto without its prefix (`IDLE`); `unknown` for
    UNSPECIFIED and for a value this version does not know (a newer participant's)."""
    if state == types_pb2.PARTICIPANT_STATE_UNSPECIFIED:
        return unknown
    try:
        return types_pb2.ParticipantState.Name(state).removeprefix(STATE_PREFIX)  # type: ignore[arg-type]
    except ValueError:
        return unknown


class _Page(Protocol):
    """A page of a paged listing (ListEpisodes, ListResults)."""

    @property
    def next_page_token(self) -> str: ...


P = TypeVar("P", bound=_Page)
Item = TypeVar("Item")


def _health_name(value: constants_pb2.HealthServiceName.ValueType) -> str:
    """The wire string of a `HealthServiceName` (its `wire_value` option in constants.proto)."""
    descriptor = constants_pb2.HealthServiceName.DESCRIPTOR.values_by_number[value]
    name: str = descriptor.GetOptions().Extensions[constants_pb2.wire_value]
    return name


READINESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_READINESS)
"""The health name answering "may new traffic come here?" (`watch_health`, `health`)."""
LIVENESS_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_PARTICIPANT_LIVENESS)
"""The health name answering "is this process alive?" (what `membership` follows)."""
SERVER_HEALTH = _health_name(constants_pb2.HEALTH_SERVICE_NAME_SERVER)
"""The whole server's health (the empty name)."""

TRANSPORT_SLACK_SECONDS = 5.0
"""The RPC timeout runs this long past the request's deadline, so the participant (which
knows what happened) reports a missed deadline rather than the transport (which does not)."""

MIN_TIMEOUT_SECONDS = 5.0


class ParticipantClient:
    """One participant at one address. Failures raise `ControlError` with the server's reason.

    The token travels as `authorization` metadata on every call (per call, because gRPC's
    call credentials are silently dropped on plaintext channels).

    Each method is one RPC of `ParticipantService` (participant_service.proto states what
    each allows and refuses). A refusal raises `ControlError` whose `reason` is the
    `ErrorInfo` reason the participant decided on; a `ControlError` without a reason (a
    timeout, a dropped connection, an unreachable address) leaves the outcome on the server
    unknown: retry the same call, every mutating RPC is idempotent for the same checkpoint
    id. `deadline` arguments are Unix seconds; the RPC's own timeout runs a little past them
    (`TRANSPORT_SLACK_SECONDS`) so the participant, which knows, reports a missed deadline.
    Read-only calls use the constructor's `timeout`. The channel opens lazily: constructing
    never fails for an unreachable address, the first call does: a new client dials afresh.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._timeout = timeout
        self._clock = clock
        options = [
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            # A subchannel of its own: gRPC shares subchannels between channels of the same
            # target and arguments, so a new client of a member that was down could get one
            # still in its reconnect backoff (up to 120 s), whose calls fail without dialling.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if credentials is None:
            self._channel = aio.insecure_channel(address, options=options)
        else:
            self._channel = aio.secure_channel(address, credentials, options=options)
        self._stub = pb_grpc.ParticipantServiceStub(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls still running fail. Idempotent."""
        await self._channel.close()

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The token, and the active span's `traceparent` (so participants join the trace)."""
        return self._metadata + context_metadata()

    def _timeout_for(self, deadline: float | None) -> float:
        if deadline is None:
            return self._timeout
        return max(MIN_TIMEOUT_SECONDS, deadline - self._clock() + TRANSPORT_SLACK_SECONDS)

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            reply = await call
        except aio.AioRpcError as error:
            raise ControlError.from_rpc_error(error) from None
        if reply is None:
            raise unparsable_reply()
        return reply

    # -- read-only ----------------------------------------------------------------------

    async def get_participant(self) -> pb.GetParticipantResponse:
        """GetParticipant: kind, instance, boot id (new per process) and versions.

        Read-only, allowed in every state; raises `ControlError` (`TOKEN_INVALID` for a
        wrong token, no reason when the participant cannot be reached)."""
        return await self._call(
            self._stub.GetParticipant(
                pb.GetParticipantRequest(), metadata=self._call_metadata(), timeout=self._timeout
            )
        )

    async def get_status(self) -> pb.GetStatusResponse:
        """GetStatus: state, active checkpoint id, lease, readiness report and counters.

        Read-only, allowed in every state; raises `ControlError`."""
        return await self._call(
            self._stub.GetStatus(
                pb.GetStatusRequest(), metadata=self._call_metadata(), timeout=self._timeout
            )
        )

    async def list_episodes(
        self, page_size: int = 0, page_token: str = ""
    ) -> pb.ListEpisodesResponse:
        """ListEpisodes: one page of the live episodes, sorted by capture key (`page_size`
        0: the server's default). Pass the reply's `next_page_token` for the next page.

        Read-only; raises `ControlError` (`INVALID_REQUEST` for a negative size or a token
        this participant did not issue, e.g. one from a replaced process)."""
        request = pb.ListEpisodesRequest(page_size=page_size, page_token=page_token)
        return await self._call(
            self._stub.ListEpisodes(request, metadata=self._call_metadata(), timeout=self._timeout)
        )

    async def all_episodes(self, page_size: int = 0) -> list[types_pb2.Episode]:
        """Every live episode, following ListEpisodes pages to the end.

        Pages are consistent per page, not across pages: an episode that starts or ends
        meanwhile may be missed or seen. Raises `ControlError` from any page."""
        return await every_page(
            lambda token: self.list_episodes(page_size, token), lambda page: page.episodes
        )

    async def watch_health(self, service: str) -> AsyncIterator[int]:
        """grpc.health.v1 Watch of `service` (no token needed): yields each status
        (`HealthCheckResponse.ServingStatus`) as the participant announces it, until the
        stream breaks, which raises `ControlError` (no reason: the process went away)."""
        request = health_pb2.HealthCheckRequest(service=service)
        stub: Any = health_pb2_grpc.HealthStub(self._channel)  # grpcio-health ships no stubs
        call = stub.Watch(request)
        try:
            async for reply in call:
                yield reply.status
        except aio.AioRpcError as error:
            raise ControlError.from_rpc_error(error) from None
        finally:
            call.cancel()

    # -- checkpoint ---------------------------------------------------------------------

    async def prepare(
        self, checkpoint_id: str, deadline: float, *, expected_boot_id: str = ""
    ) -> AsyncIterator[pb.PrepareResponse]:
        """Yield the Prepare stream's messages; the last has `final` set.

        Prepare closes admission and streams progress until the participant is ready or
        `deadline` passes: the final message says PREPARED, PREPARING (not ready in time;
        admission stays closed: Resume, or Prepare again with a later deadline) or IDLE (a
        Resume or lease expiry ended it). Retrying with the same id re-attaches; a recorded
        Prepare replays one final message (`replayed`). Leaving the loop early cancels the
        stream, not the checkpoint. Raises `ControlError`: `STALE_CHECKPOINT`,
        `CHECKPOINT_CONFLICT`, `INVALID_PHASE`, `CHECKPOINT_DEADLINE_EXCEEDED`,
        `INVALID_REQUEST`, `HOOK_FAILED` (closing admission raised; it reopened),
        `BOOT_ID_MISMATCH` (`expected_boot_id` given and the process is another one; nothing
        changed)."""
        request = pb.PrepareRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            expected_boot_id=expected_boot_id,
        )
        call: Any = self._stub.Prepare(
            request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
        )
        try:
            async for message in call:
                if message is None:
                    raise unparsable_reply()
                yield message
        except aio.AioRpcError as error:
            raise ControlError.from_rpc_error(error) from None
        finally:
            call.cancel()

    async def prepare_until_final(
        self,
        checkpoint_id: str,
        deadline: float,
        on_update: Callable[[pb.PrepareResponse], None] | None = None,
    ) -> pb.PrepareResponse:
        """Read the Prepare stream to its final message and return that message.

        `on_update` sees every message, the final one included. Raises what `prepare`
        raises, and `ControlError` UNAVAILABLE without a reason when the stream ended
        without a final message (the outcome is unknown: Prepare again with the same id)."""
        final: pb.PrepareResponse | None = None
        async for message in self.prepare(checkpoint_id, deadline):
            if on_update is not None:
                on_update(message)
            if message.final:
                final = message
        if final is None:
            raise ControlError(
                grpc.StatusCode.UNAVAILABLE, "the Prepare stream ended without a final message"
            )
        return final

    async def renew(self, checkpoint_id: str, deadline: float) -> pb.RenewResponse:
        """Renew: extend the active checkpoint's lease to `deadline` + the lease grace (a
        lease never shrinks). Idempotent. Raises `ControlError`: `STALE_CHECKPOINT`,
        `CHECKPOINT_CONFLICT`, `INVALID_PHASE` (IDLE), `CHECKPOINT_DEADLINE_EXCEEDED`,
        `INVALID_REQUEST`."""
        request = pb.RenewRequest(checkpoint_id=checkpoint_id, deadline=timestamp(deadline))
        return await self._call(
            self._stub.Renew(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def commit(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: Iterable[EpisodeId] | None = None,
        *,
        asynchronous: bool = False,
    ) -> pb.CommitResponse:
        """Commit; `scope=None` is unscoped (every live episode), an empty iterable is none.

        `asynchronous`: the reply comes once the snapshot is taken (`snapshot_only`, no
        manifest yet) and the part is written in the background: `await_part` reports when
        it is durable. A retry must repeat it (it is one of the commit's arguments).

        Exports once and publishes this participant's part under `checkpoint_dir` (absolute).
        Idempotent with the same directory and scope: the identical reply. Raises
        `ControlError`: `STALE_CHECKPOINT` (also when a Resume stopped it),
        `CHECKPOINT_CONFLICT`, `INVALID_PHASE` (not PREPARED, or no longer ready),
        `SCOPE_REQUIRED` (unscoped to a policy model), `CHECKPOINT_DEADLINE_EXCEEDED` (a retry
        awaits the same write), `UNSERIALIZABLE_STATE`, `HOOK_FAILED`, `STORAGE_FAILED`,
        `INVALID_CHECKPOINT_STATE`, `INVALID_REQUEST`."""
        request = pb.CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            checkpoint_dir=checkpoint_dir,
            asynchronous=asynchronous,
        )
        if scope is not None:
            request.scope.CopyFrom(scope_message(scope))
        return await self._call(
            self._stub.Commit(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def await_part(
        self, checkpoint_id: str, deadline: float | None = None
    ) -> pb.AwaitPartResponse:
        """AwaitPart: the outcome of an asynchronous commit's background write (DURABLE with
        its manifest, FAILED with a typed reason, UNKNOWN), waiting until `deadline` while it
        is still WRITING (None: answer at once).

        Read-only, allowed in every state, also after the id was resumed; raises
        `ControlError` (`INVALID_REQUEST`)."""
        request = pb.AwaitPartRequest(checkpoint_id=checkpoint_id)
        if deadline is not None:
            request.deadline.CopyFrom(timestamp(deadline))
        return await self._call(
            self._stub.AwaitPart(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def restore(
        self,
        checkpoint_id: str,
        deadline: float,
        checkpoint_dir: str,
        scope: Iterable[EpisodeId],
        *,
        rejoin: bool = False,
    ) -> pb.RestoreResponse:
        """Restore: install the part under `checkpoint_dir` as attempt N+1 of every episode
        in `scope` (the checkpointed attempts N), all or nothing, into a fresh process.
        `checkpoint_id` is a new control id of this restore, not the checkpoint's.

        `rejoin`: the process may have served (a survivor of a fleet whose crashed member was
        replaced): it first retires every episode it holds (late requests of them are then
        refused `stale_attempt`) and forgets having served, then restores like a fresh one.

        Idempotent with the same directory, scope and `rejoin`; on failure nothing stays
        installed and a retry works. Raises `ControlError`: `FRESH_PROCESS_REQUIRED`, `INVALID_PHASE`,
        `STALE_CHECKPOINT`, `CHECKPOINT_CONFLICT`, `CHECKPOINT_DEADLINE_EXCEEDED`,
        `INVALID_CHECKPOINT_STATE` (metadata `captureKey` names a rejected episode),
        `TASK_MISMATCH`, `HOOK_FAILED`, `STORAGE_FAILED`, `INVALID_REQUEST`."""
        request = pb.RestoreRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            checkpoint_dir=checkpoint_dir,
            scope=scope_message(scope),
            rejoin=rejoin,
        )
        return await self._call(
            self._stub.Restore(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def resume(self, checkpoint_id: str, deadline: float) -> pb.ResumeResponse:
        """Resume: reopen admission; also the abort of an unfinished checkpoint.

        Allowed in every state, idempotent (an id already resumed answers `idempotent`); a
        deadline already past is not refused. Raises `ControlError`: `CHECKPOINT_CONFLICT`
        (another checkpoint is active), `CHECKPOINT_DEADLINE_EXCEEDED` (a running install or
        cleanup outlived it: nothing changed, retry later)."""
        request = pb.ResumeRequest(checkpoint_id=checkpoint_id, deadline=timestamp(deadline))
        return await self._call(
            self._stub.Resume(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def retire(
        self, checkpoint_id: str, deadline: float, episodes: Iterable[EpisodeId]
    ) -> pb.RetireResponse:
        """Retire: refuse, stop and free `episodes` and every earlier attempt of their
        rollouts; answers once all is freed. Idempotent.

        Allowed in IDLE and in RESTORED with the restore's id. Raises `ControlError`:
        `INVALID_PHASE` (a checkpoint is open: resume first), `CHECKPOINT_CONFLICT`,
        `CHECKPOINT_DEADLINE_EXCEEDED` (cut short: the attempts stay refused; retry),
        `HOOK_FAILED`, `INVALID_REQUEST` (no episodes, or an invalid one)."""
        request = pb.RetireRequest(
            checkpoint_id=checkpoint_id,
            deadline=timestamp(deadline),
            episodes=[episode_message(e) for e in episodes],
        )
        return await self._call(
            self._stub.Retire(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def forget(
        self, checkpoint_id: str, deadline: float, rollout_ids: Iterable[str]
    ) -> pb.ForgetResponse:
        """Forget: drop the retired marks of rollouts that can no longer run anywhere, so a
        new attempt of them is admitted again. Idempotent.

        Raises `ControlError`: `RETIRE_INCOMPLETE` (retire them again first),
        `CHECKPOINT_CONFLICT`, `INVALID_PHASE`, `CHECKPOINT_DEADLINE_EXCEEDED`,
        `INVALID_REQUEST`."""
        request = pb.ForgetRequest(
            checkpoint_id=checkpoint_id, deadline=timestamp(deadline), rollout_ids=list(rollout_ids)
        )
        return await self._call(
            self._stub.Forget(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def list_results(
        self, page_size: int = 0, page_token: str = ""
    ) -> pb.ListResultsResponse:
        """ListResults: one page of the results held until their receipts are acknowledged
        (`page_size` 0: 100), sorted by capture key, with how many are held and the cap.

        Read-only; raises `ControlError` (`INVALID_REQUEST` for a negative size or a token
        this participant did not issue)."""
        request = pb.ListResultsRequest(page_size=page_size, page_token=page_token)
        return await self._call(
            self._stub.ListResults(request, metadata=self._call_metadata(), timeout=self._timeout)
        )

    async def all_results(self, page_size: int = 0) -> list[pb.HeldResult]:
        """Every held result, following ListResults pages to the end."""
        return await every_page(
            lambda token: self.list_results(page_size, token), lambda page: page.results
        )

    async def acknowledge_results(
        self, receipts: Iterable[pb.ResultReceipt | Receipt], deadline: float
    ) -> pb.AcknowledgeResultsResponse:
        """AcknowledgeResults: the caller persisted these results; the participant releases
        them. Idempotent (a receipt not held any more is counted in `not_held`).

        Raises `ControlError`: `RECEIPT_MISMATCH` (one names a held attempt with another
        digest; nothing released), `CHECKPOINT_DEADLINE_EXCEEDED`, `INVALID_REQUEST`."""
        request = pb.AcknowledgeResultsRequest(
            deadline=timestamp(deadline), receipts=[_receipt_message(r) for r in receipts]
        )
        return await self._call(
            self._stub.AcknowledgeResults(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )

    async def set_weight_version(self, version: int, deadline: float) -> int:
        """SetWeightVersion: the policy model stamps the calls admitted from now on with
        `version`; returns the version before. Idempotent; allowed in every state.

        Raises `ControlError`: `INVALID_REQUEST` (not a policy model, a version above
        2^63-1), `CHECKPOINT_DEADLINE_EXCEEDED`."""
        request = pb.SetWeightVersionRequest(deadline=timestamp(deadline), weight_version=version)
        reply: pb.SetWeightVersionResponse = await self._call(
            self._stub.SetWeightVersion(
                request, metadata=self._call_metadata(), timeout=self._timeout_for(deadline)
            )
        )
        return reply.previous


async def every_page(
    fetch: Callable[[str], Awaitable[P]], items: Callable[[P], Iterable[Item]]
) -> list[Item]:
    """Every item of a paged listing: `fetch(token)` from "" until a page has no
    `next_page_token`."""
    collected: list[Item] = []
    token = ""
    while True:
        page = await fetch(token)
        collected.extend(items(page))
        token = page.next_page_token
        if not token:
            return collected


def _receipt_message(receipt: pb.ResultReceipt | Receipt) -> pb.ResultReceipt:
    if isinstance(receipt, pb.ResultReceipt):
        return receipt
    return pb.ResultReceipt(**receipt.as_json())


def receipt_from_header(value: str) -> pb.ResultReceipt:
    """The receipt of an `x-rollout-receipt` reply header (its JSON); ValueError for
    anything else. A trainer keeps it with the persisted result and acknowledges it."""
    try:
        fields = json.loads(value)
        return pb.ResultReceipt(
            rollout_id=fields["rollout_id"],
            attempt=fields["attempt"],
            result_sha256=fields["result_sha256"],
            lineage=fields["lineage"],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a result receipt: {value[:200]!r}") from exc


def receipt_of_message(message: pb.ResultReceipt) -> Receipt:
    """The `Receipt` (what a `ResultLedger` keeps) of a `ResultReceipt` message, every field
    checked; ValueError for one no entry would issue."""
    return Receipt.from_json(
        {
            "rollout_id": message.rollout_id,
            "attempt": message.attempt,
            "result_sha256": message.result_sha256,
            "lineage": list(message.lineage),
        }
    )


def unparsable_reply() -> ControlError:
    """A reply whose bytes do not parse as its message. grpc.aio logs the decoding error and
    hands the caller None instead of raising, which a controller would take for an answer (a
    Prepare stream would seem to have ended; a Resume, to have succeeded): this makes it the
    failed call it is, INTERNAL with no reason, as the synchronous grpc library reports it."""
    return ControlError(
        grpc.StatusCode.INTERNAL, "the participant's reply does not parse (not this API's message)"
    )
