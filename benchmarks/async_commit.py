"""Benchmark 11: the pause the data plane sees and the time to durable, synchronous vs
asynchronous commits, on local disk and on an object store (SeaweedFS), with and without
50 ms of added latency per S3 request.

One participant (the tests' `DoubleParticipant`, holding N sessions of S bytes) and its
`ControlPlane` in this process, with the participant's own storage (`PartStorage`: local disk,
or `s3://` through obstore with the credentials in the standard variables). One checkpoint:

* pause: from Prepare (admission closes) until Resume returned (admission open again);
* export: the participant's export hook alone (a deep copy of every state here), and the
  snapshot's serialization to bytes (asynchronous mode; the synchronous write serializes as
  it writes);
* durable: from Prepare until the part is published (synchronous: Commit's reply;
  asynchronous: AwaitPart reporting DURABLE).

Synchronous and asynchronous checkpoints alternate, so each ratio compares runs taken side by
side. The goal of issue 20: the asynchronous pause is at most the export (hook plus
snapshot) plus 10 %, and it does not grow with storage latency: the object-store cases run
again through a loopback TCP proxy that holds every S3 request 50 ms before forwarding it.

Without a built `weed` binary (`scripts/seaweedfs`) the object-store cases are skipped (the
local-disk ones still run) and the result's `params.object_store` says why; it never builds
it (minutes).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.runtime.control_plane import ControlPlane, ControlSettings
from rollout_checkpoint.server.runtime.part_writes import PartWriteState

from .common import BenchResult, ms, now, ratios
from .object_store import built_weed

PROXY_DELAY_SECONDS = 0.05
DEADLINE_SECONDS = 600.0


class DelayProxy:
    """A loopback TCP proxy that holds each request `delay` seconds before forwarding it.

    A request is the first bytes a client sends after the server last answered on that
    connection (HTTP/1.1 keep-alive: one request at a time per connection)."""

    def __init__(self, host: str, port: int, delay: float) -> None:
        self.host, self.port, self.delay = host, port, delay
        self.requests = 0
        self.listen_port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.listen_port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every connection still open (the store client keeps them
        alive), so no handler outlives the benchmark."""
        if self._server is not None:
            self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._forward(reader, writer)
        except (asyncio.CancelledError, ConnectionError):
            pass  # closed by `close`, or by either side
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)
        expecting_request = [True]

        async def client_to_server() -> None:
            while data := await reader.read(1 << 16):
                if expecting_request[0]:
                    expecting_request[0] = False
                    self.requests += 1
                    await asyncio.sleep(self.delay)
                upstream_writer.write(data)
                await upstream_writer.drain()
            upstream_writer.close()

        async def server_to_client() -> None:
            while data := await upstream_reader.read(1 << 16):
                expecting_request[0] = True
                writer.write(data)
                await writer.drain()
            writer.close()

        try:
            await asyncio.gather(client_to_server(), server_to_client(), return_exceptions=True)
        finally:
            upstream_writer.close()


@dataclass(frozen=True)
class Store:
    """Where one series of checkpoints goes: a label, a root, and the store variables it
    needs (an object store's endpoint: the direct one or the delaying proxy's; the store
    client is cached per set of variables, so switching them switches the client)."""

    label: str
    root: str
    environment: dict[str, str] = field(default_factory=dict)


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    cases: list[tuple[int, int]] = params.async_commit_states
    repeats: int = params.async_commit_repeats
    result = BenchResult(
        "async_commit",
        "11. Asynchronous commits: the pause and the time to durable, sync vs async",
        "One participant of N sessions of S bytes, its ControlPlane in this process. Pause: "
        "Prepare (admission closed) to Resume returned (open). Export: the export hook; "
        "snapshot: its serialization to bytes. Durable: Prepare to the part published "
        "(sync: Commit's reply; async: AwaitPart DURABLE). Local disk, SeaweedFS, and "
        "SeaweedFS behind a proxy adding 50 ms per S3 request, interleaved round by round "
        "on one participant per size; sync and async alternate within each.",
        params={"states": cases, "repeats": repeats, "proxy_delay_ms": PROXY_DELAY_SECONDS * 1e3},
    )
    work = Path(tempfile.mkdtemp(prefix="async-commit-", dir=ctx.workdir))
    local = Store("local disk", str(work / "local"))
    try:
        weed = built_weed()
        if weed is None:
            # The local-disk cases run: the result is not skipped, its object-store half is.
            result.params["object_store"] = (
                "skipped: no SeaweedFS weed binary built here (scripts/seaweedfs builds it)"
            )
            ctx.say(f"async_commit: object-store cases {result.params['object_store']}")
            for count, size in cases:
                await _measure(ctx, result, [local], count, size, repeats)
            return result
        async with _object_stores(ctx, work) as (direct, delayed, proxy):
            for count, size in cases:
                await _measure(ctx, result, [local, direct, delayed], count, size, repeats)
            result.params["proxied_requests"] = proxy.requests
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


@asynccontextmanager
async def _object_stores(ctx: Any, work: Path) -> AsyncIterator[tuple[Store, Store, DelayProxy]]:
    """SeaweedFS, and the same server behind the delaying proxy: two stores of one bucket."""
    from tests.s3_server import SeaweedS3

    weed = built_weed()
    assert weed is not None
    server = SeaweedS3(weed, work / "seaweedfs")
    saved = {name: os.environ.get(name) for name in server.connection.environment()}
    proxy: DelayProxy | None = None
    try:
        ctx.say("async_commit: starting SeaweedFS")
        await asyncio.to_thread(server.start)
        environment = server.connection.environment()
        os.environ.update(environment)
        prefix = f"s3://{server.connection.bucket}/bench-async/{secrets.token_hex(4)}"
        endpoint = urlsplit(environment["AWS_ENDPOINT_URL"])
        assert endpoint.hostname is not None and endpoint.port is not None
        proxy = DelayProxy(endpoint.hostname, endpoint.port, PROXY_DELAY_SECONDS)
        await proxy.start()
        proxied = urlunsplit(endpoint._replace(netloc=f"127.0.0.1:{proxy.listen_port}"))
        yield (
            Store("SeaweedFS", f"{prefix}/direct", environment),
            Store(
                f"SeaweedFS +{PROXY_DELAY_SECONDS * 1e3:g} ms/request",
                f"{prefix}/delayed",
                environment | {"AWS_ENDPOINT_URL": proxied},
            ),
            proxy,
        )
    finally:
        if proxy is not None:
            await proxy.close()
        await asyncio.to_thread(server.close)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


Runs = dict[
    str, dict[bool, dict[str, list[float]]]
]  # store label -> asynchronous -> name -> samples


async def _measure(
    ctx: Any, result: BenchResult, stores: list[Store], count: int, size: int, repeats: int
) -> None:
    """One participant of `count` states, checkpointed round by round to every store in
    turn, each synchronously then asynchronously: every comparison, across modes and across
    stores, is between runs taken side by side on the same heap. (Measured one store after
    the other, the export hook alone moved 176 -> 226 ms between two cases of one run, which
    read as a pause that grew with storage latency.)"""
    from tests.double import DoubleParticipant

    participant = DoubleParticipant("bench")
    exports: list[float] = []
    original_export = participant.export

    async def timed_export(scope: frozenset[EpisodeId] | None) -> Any:
        started = now()
        try:
            return await original_export(scope)
        finally:
            exports.append(now() - started)

    participant.export = timed_export  # type: ignore[method-assign]
    control = ControlPlane(participant, ControlSettings(), storage=PartStorage())
    await control.start()
    blob = "x" * max(size - 60, 1)
    for i in range(count):
        participant.seed(EpisodeId(f"s{i:06d}"), {"blob": blob})
    states = f"{count} x {size / 1000:g} KB"
    ctx.say(f"async_commit: {states}, {repeats} repeats on {', '.join(s.label for s in stores)}")
    runs: Runs = {
        store.label: {
            mode: {"pause": [], "durable": [], "export": [], "snapshot": []}
            for mode in (False, True)
        }
        for store in stores
    }
    try:
        for repeat in range(repeats + 1):  # the first round of each store and mode is unmeasured
            for store in stores:
                os.environ.update(store.environment)
                # A directory of its own per case and round: parts are never replaced.
                root = f"{store.root}/{count}x{size}/r{repeat}"
                for asynchronous in (False, True):
                    figures = await _checkpoint(
                        control, exports, f"{root}-{int(asynchronous)}", asynchronous
                    )
                    if repeat:
                        for name, value in figures.items():
                            runs[store.label][asynchronous][name].append(value)
    finally:
        await control.close()
    for store in stores:
        _report_store(result, f"{store.label}, {states}", runs[store.label])
    if len(stores) == 3:  # local disk, the direct object store, the slowed one
        _, direct, slowed = stores
        _report_latency(result, states, slowed.label, direct.label, runs)


def _report_store(result: BenchResult, case: str, runs: dict[bool, dict[str, list[float]]]) -> None:
    sync, asynchronous = runs[False], runs[True]
    result.figure(f"{case}: sync pause", "Prepare -> Resume", "ms", map(ms, sync["pause"]))
    result.figure(f"{case}: async pause", "Prepare -> Resume", "ms", map(ms, asynchronous["pause"]))
    result.figure(f"{case}: export", "export hook", "ms", map(ms, asynchronous["export"]))
    result.figure(
        f"{case}: async export + snapshot",
        "hook + serialization",
        "ms",
        map(ms, asynchronous["snapshot"]),
    )
    result.figure(f"{case}: sync durable", "Prepare -> published", "ms", map(ms, sync["durable"]))
    result.figure(
        f"{case}: async durable",
        "Prepare -> AwaitPart DURABLE",
        "ms",
        map(ms, asynchronous["durable"]),
    )
    result.ratio(
        f"{case}: async pause / (export + snapshot)",
        "async pause",
        "export + snapshot",
        ratios(asynchronous["pause"], asynchronous["snapshot"]),
    )
    result.ratio(
        f"{case}: async pause / sync pause",
        "async pause",
        "sync pause",
        ratios(asynchronous["pause"], sync["pause"]),
    )
    result.ratio(
        f"{case}: async durable / sync durable",
        "async durable",
        "sync durable",
        ratios(asynchronous["durable"], sync["durable"]),
    )


def _report_latency(result: BenchResult, states: str, slowed: str, direct: str, runs: Runs) -> None:
    """What the added storage latency does to each figure, in rounds taken side by side:
    the goal is an asynchronous pause unchanged by it (ratio 1), while the synchronous one
    grows by the requests it waits for."""
    slow, fast = runs[slowed], runs[direct]
    for name, mode, samples in (
        ("async pause", True, "pause"),
        ("sync pause", False, "pause"),
        ("export hook", True, "export"),
    ):
        result.ratio(
            f"{states}: {name}, {slowed} / {direct}",
            f"{name} with the added latency",
            f"{name} without",
            ratios(slow[mode][samples], fast[mode][samples]),
        )


async def _checkpoint(
    control: ControlPlane, exports: list[float], directory: str, asynchronous: bool
) -> dict[str, float]:
    checkpoint_id = f"b{secrets.token_hex(6)}"
    deadline = time.time() + DEADLINE_SECONDS
    if not directory.startswith("s3://"):
        await asyncio.to_thread(os.makedirs, directory, exist_ok=True)
    started = now()
    updates = await control.prepare(checkpoint_id, deadline)
    async for update in updates:
        if update.final:
            break
    exports.clear()
    committing = now()
    result = await control.commit(
        checkpoint_id, deadline, directory, None, asynchronous=asynchronous
    )
    committed = now()
    await control.resume(checkpoint_id, deadline)
    reopened = now()
    if asynchronous:
        assert result.snapshot_only
        write = await control.await_part(checkpoint_id, deadline)
        assert write is not None and write.state is PartWriteState.DURABLE, write
        durable = now()
    else:
        assert result.manifest is not None
        durable = committed
    return {
        "pause": reopened - started,
        "durable": durable - started,
        "export": exports[0] if exports else 0.0,
        "snapshot": committed - committing,
    }
