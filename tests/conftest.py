"""Shared fixtures: real servers on 127.0.0.1:0, real HTTP, real gRPC, an injected clock."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
import uvicorn
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.server.core.part_storage import CheckpointStorage
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .clocks import ObservedClock
from .double import DoubleParticipant, create_app
from .processes import REPO, kill_group, started
from .s3_server import s3_server_fixture

__all__ = ["REPO", "kill_group"]  # imported from here by the test modules

# The session's S3 server (SeaweedFS), shared by every module that asks for `s3_server`:
# registered once here, since pytest keys a fixture by where it is registered.
s3_server = s3_server_fixture

TOKEN = "s3cret-token-for-tests"
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# -- `slow` runs only when asked for ----------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test (or a parametrized case) marked `slow` is skipped unless the run selects slow
    tests (`-m slow`, `-m "slow or ..."`): the mark alone decides, as `only_when_asked_for`
    does inside a test, so a case marked by its parameters cannot add minutes to every
    `scripts/test` unnoticed."""
    expression = config.getoption("markexpr", "") or ""
    if "slow" in expression.replace("not slow", ""):
        return
    skip = pytest.mark.skip(reason="a larger budget: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


# -- a timed-out test fails alone -------------------------------------------------------------

TIMED_OUT_CLEANUP_SECONDS = 30.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's signal method raises its failure wherever the main thread is: in an
    async test, inside the session loop's select(). That leaves the test's coroutine suspended
    on the loop for good, its `finally` blocks (killing processes, stopping servers) never run.
    Cancel it, and let those clean-ups run (bounded) before the next test."""
    try:
        return (yield)
    except pytest.fail.Exception as failure:
        if "from pytest-timeout" in str(failure):
            _cancel_interrupted_test(failure)
        raise


def _cancel_interrupted_test(failure: BaseException) -> None:
    # The interrupted `loop.run_until_complete(future)` is on the failure's traceback: its
    # frame holds the very loop and task (the test's coroutine) that were cut off.
    tb = failure.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        loop, task = frame.f_locals.get("self"), frame.f_locals.get("future")
        if (
            frame.f_code.co_name == "run_until_complete"
            and isinstance(loop, asyncio.AbstractEventLoop)
            and isinstance(task, asyncio.Task)
        ):
            if not task.done() and not loop.is_running() and not loop.is_closed():
                task.cancel()
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.wait({task}, timeout=TIMED_OUT_CLEANUP_SECONDS))
            return
        tb = tb.tb_next


# -- a report that UTF-8 cannot carry does not end the run ----------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """scripts/test runs two pytest workers (pytest-xdist), whose reports travel to the main
    process as UTF-8. Tests feed lone surrogates to the servers on purpose (hostile ids and
    payloads), and a captured log line or failure message holding one would end the whole
    run with an INTERNALERROR instead of reporting that test. Escape them in the report."""
    report = yield
    report.sections = [(title, _utf8(text)) for title, text in report.sections]
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        path, line, message = report.longrepr
        report.longrepr = (path, line, _utf8(message))
    elif report.longrepr is not None:  # a failure: kept as it is unless UTF-8 cannot carry it
        text = str(report.longrepr)
        if _utf8(text) != text:
            report.longrepr = _utf8(text)
    return report


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class Harness:
    """One running double: its participant, runtime, clock and clients."""

    participant: DoubleParticipant
    runtime: CheckpointRuntime
    clock: ObservedClock
    http: httpx.AsyncClient
    client: ParticipantClient
    grpc_address: str
    server: uvicorn.Server
    serving: asyncio.Future[None]

    @property
    def control(self) -> Any:
        return self.runtime.control

    def deadline(self, seconds: float = 60.0) -> float:
        return self.clock.now() + seconds

    async def health(self, service: str) -> int:
        async with aio.insecure_channel(self.grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            return int(reply.status)

    async def until(self, predicate: Any, timeout: float = 30.0) -> None:
        """Wait until `predicate()` holds, re-checking whenever the control plane changes."""
        await until_changed(self.runtime.control, predicate, timeout)

    async def wait_health(self, service: str, status: int, timeout: float = 30.0) -> None:
        """Watch a health name until it reports `status` (health follows asynchronously)."""
        async with aio.insecure_channel(self.grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            async for reply in watch:
                if reply.status == status:
                    watch.cancel()
                    return
        raise AssertionError(f"health {service!r} never reached {status}")


async def until_changed(control: Any, predicate: Any, timeout: float = 30.0) -> None:
    """Wait until `predicate()` holds, re-checked whenever `control` (a control plane)
    changes: a state reached by an event, never by sleeping, and bounded by `timeout`."""
    changed = asyncio.Event()
    control.add_listener(changed.set)
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await changed.wait()
                changed.clear()
    finally:
        control.remove_listener(changed.set)


async def start_harness(
    *,
    storage: CheckpointStorage | None = None,
    participant: DoubleParticipant | None = None,
    clock: ObservedClock | None = None,
    tracer_provider: Any = None,
    **settings: Any,
) -> Harness:
    clock = clock or ObservedClock()
    participant = participant or DoubleParticipant()
    app = create_app(participant)
    config = CheckpointSettings(enabled=True, token=TOKEN, **settings)
    runtime = install_checkpointing(
        app, participant, config, clock=clock, storage=storage, tracer_provider=tracer_provider
    )
    assert runtime is not None
    server, serving, http_port = await serve_app(app)
    address = f"127.0.0.1:{runtime.port}"
    return Harness(
        participant=participant,
        runtime=runtime,
        clock=clock,
        http=httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30),
        client=ParticipantClient(address, TOKEN, clock=clock.now),
        grpc_address=address,
        server=server,
        serving=serving,
    )


async def stop_harness(harness: Harness) -> None:
    await harness.http.aclose()
    await harness.client.close()
    harness.participant.gates.setdefault("http-hold", asyncio.Event()).set()
    for gate in harness.participant.gates.values():
        gate.set()
    harness.server.should_exit = True
    await harness.serving


async def serve_app(app: Any, **config: Any) -> tuple[uvicorn.Server, asyncio.Future[None], int]:
    """Run `app` under uvicorn on 127.0.0.1:0 in this loop; return once it listens.

    `config` overrides uvicorn.Config's options (a load test keeps idle connections open)."""
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "lifespan": "on",
        "log_level": "warning",
        "timeout_graceful_shutdown": 2,
        **config,
    }
    server = _StartedServer(uvicorn.Config(app, **options))
    serving = asyncio.ensure_future(server.serve())
    started = asyncio.ensure_future(server.started_event.wait())
    await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        serving.result()
        raise RuntimeError("the server stopped during startup")
    return server, serving, server.servers[0].sockets[0].getsockname()[1]


class _StartedServer(uvicorn.Server):
    """uvicorn's server with an event for "started" (lifespan done, sockets bound)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.started_event.set()


@pytest_asyncio.fixture
async def harness() -> AsyncIterator[Harness]:
    h = await start_harness()
    try:
        yield h
    finally:
        await stop_harness(h)


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


# -- processes ------------------------------------------------------------------------------


@dataclass
class DoubleProcess:
    process: subprocess.Popen[str]
    http_port: int
    grpc_port: int

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def spawn_double(*args: str, stderr: Path | None = None) -> DoubleProcess:
    """Start `python -m tests.double` in its own process group; wait for its ports line.

    With `stderr`, the process's stderr goes to that file (to inspect its logs)."""
    env = dict(os.environ, DOUBLE_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
    process, ports = started(
        [sys.executable, "-m", "tests.double", *args], "the double", env=env, log=stderr
    )
    return DoubleProcess(process, ports["http_port"], ports["grpc_port"])


@pytest.fixture
def spawn() -> Iterator[Any]:
    doubles: list[DoubleProcess] = []

    def start(*args: str, stderr: Path | None = None) -> DoubleProcess:
        double = spawn_double(*args, stderr=stderr)
        doubles.append(double)
        return double

    try:
        yield start
    finally:
        for double in doubles:
            kill_group(double.process)


async def prepared(h: Harness, checkpoint_id: str = "c1") -> None:
    """Prepare the harness's participant and check that it reached PREPARED."""
    final = (await drain(h.client.prepare(checkpoint_id, h.deadline())))[-1]
    assert final.state == types_pb2.PARTICIPANT_STATE_PREPARED


# -- files ----------------------------------------------------------------------------------


def temporaries(part: Path) -> list[str]:
    """The temporary files a part directory holds (a crashed or stopped write's leftovers)."""
    if not part.exists():
        return []
    return sorted(
        name
        for name in os.listdir(part)
        if name.startswith((".records-", ".manifest-")) or name.endswith(".tmp")
    )


def tree(root: Path) -> list[str]:
    """Every path under `root` (relative), directories included, sorted."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def grpc_code(name: str) -> grpc.StatusCode:
    return grpc.StatusCode[name]


async def refused(call: Any, reason: str, code: str | None = None) -> Any:
    """Await a client call that must fail with this ErrorInfo reason (and status code)."""
    from rollout_checkpoint.client.errors import ControlError

    with pytest.raises(ControlError) as caught:
        await call
    assert caught.value.reason == reason, caught.value
    if code is not None:
        assert caught.value.code == grpc.StatusCode[code], caught.value
    return caught.value


async def drain(stream: Any) -> list[Any]:
    return [message async for message in stream]
