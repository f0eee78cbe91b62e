"""A checkpoint store that stops answering costs a controller its deadline, not more.

An object store that accepts connections but never answers (SeaweedFS stopped with SIGSTOP)
or a frozen local filesystem (`tests/frozen_storage.py` stalls the root's I/O for good) left
`checkpoint --timeout 10`, `restore --timeout 10` and `inspect` waiting for the store
client's own 120 s request timeout, or for the thaw, and then reported the store's failure
as INVALID_CHECKPOINT_STATE. Here each is STORAGE_FAILED (exit 4) within its deadline plus a
margin for a Python process's start and exit under load; the fleet is left open; a
publication abandoned at its deadline does not publish when its thread wakes up; and a
participant whose part write hangs still exits within its shutdown grace after SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc import aio

from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint, restore_published
from rollout_checkpoint.client.checkpointing.publication import (
    CheckpointRoot,
    StorageFailed,
    open_checkpoint_root,
)
from rollout_checkpoint.client.coordinator.service import Coordinator
from rollout_checkpoint.client.errors import ControlError
from rollout_checkpoint.client.fleet import Fleet, FleetSpec
from rollout_checkpoint.client.participant import timestamp
from rollout_checkpoint.server.core.clock import SystemClock
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .conftest import TOKEN, start_harness, stop_harness
from .frozen_storage import FROZEN_LINE
from .processes import REPO, kill_group, start, started
from .s3_server import SeaweedS3
from .test_collect import wait_until

TIMEOUT = 6.0
"""The --timeout / deadline given to every call against a hung store."""
PROCESS_MARGIN = 10.0
"""A CLI process's start (imports, fleet discovery) and exit on a loaded 2-core machine."""
GUARD = TIMEOUT + 60
"""Where a test stops waiting for a call that ignores its deadline (before the fix: 120 s)."""
CALL_MARGIN = 3.0
"""An in-process call: the deadline is the caller's own, only scheduling is added."""
SHUTDOWN_GRACE = 10.0 + 5.0
"""README "Shutdown": uvicorn drains HTTP for up to 10 s, then the sidecar stops with
SHUTDOWN_GRACE_SECONDS (5)."""
AUTH = (("authorization", f"Bearer {TOKEN}"),)

Result = tuple[float, int, str, str]
"""A process's seconds from start to exit, exit code, stdout and stderr."""


@pytest.fixture
def url(s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix on the session's S3 server, its credentials in this process's (and so
    every child's) environment."""
    for name, value in s3_server.connection.environment().items():
        monkeypatch.setenv(name, value)
    return s3_server.connection.url(f"deadlines/{secrets.token_hex(6)}")


@contextlib.contextmanager
def stopped(server: SeaweedS3) -> Iterator[None]:
    """The whole S3 server stopped (SIGSTOP): its sockets accept, nothing answers."""
    assert server.process is not None
    group = server.process.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR", **extra or {})


def cli_command(*args: str, frozen: str | None = None) -> list[str]:
    """The CLI, optionally in a process whose `safe_files.<frozen>` never returns."""
    if frozen is None:
        return [sys.executable, "-m", "rollout_checkpoint.client.cli.main", *args]
    return [
        sys.executable,
        "-m",
        "tests.frozen_storage",
        frozen,
        "rollout_checkpoint.client.cli.main",
        *args,
    ]


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_command(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def timed(commands: dict[str, list[str]], env: dict[str, str], work: Path) -> dict[str, Result]:
    """Run the commands at once; each one's result, timed on its own (its stderr goes to
    `work`). Bounded far beyond any expectation: a stall that is not bounded is the failure,
    not a hung test."""
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        running = {
            name: pool.submit(_timed, command, env, work / f"{name}.stderr")
            for name, command in commands.items()
        }
        return {name: future.result() for name, future in running.items()}


def _timed(command: list[str], env: dict[str, str], log: Path) -> Result:
    began = time.monotonic()
    process = start(command, env=env, log=log)
    try:
        out, _ = process.communicate(timeout=GUARD)
    except subprocess.TimeoutExpired:
        kill_group(process)
        out, _ = process.communicate()
    return time.monotonic() - began, process.returncode, out, log.read_text(errors="replace")


def three_verbs(
    fleet: Path, location: str, checkpoint_id: str | None = None, *, frozen: str | None = None
) -> dict[str, list[str]]:
    """`checkpoint` (with `checkpoint_id`, else a new id), `restore --rejoin` of LATEST and
    `inspect` of `location`, each with `--timeout TIMEOUT --json`."""
    bounded = ("--timeout", str(TIMEOUT), "--json")
    taken = (checkpoint_id,) if checkpoint_id else ()
    return {
        "checkpoint": cli_command(
            "checkpoint", "--fleet", str(fleet), *bounded, *taken, frozen=frozen
        ),
        "restore": cli_command(
            "restore", "--fleet", str(fleet), "--rejoin", *bounded, "restore-1", frozen=frozen
        ),
        "inspect": cli_command("inspect", location, *bounded, frozen=frozen),
    }


def assert_storage_failed(name: str, result: Result) -> None:
    seconds, code, out, err = result
    assert code == 4, f"{name}: exit {code} after {seconds:.1f} s\n{out}\n{err}"
    reason = json.loads(out.strip().splitlines()[-1])["error"]["reason"]
    assert reason == "STORAGE_FAILED", f"{name}: {out}"
    assert seconds < TIMEOUT + PROCESS_MARGIN, f"{name} took {seconds:.1f} s: {out}"


def counter(
    env: dict[str, str], *extra: str, frozen: str | None = None, log: Path | None = None
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """The counter example (a resources server), its storage frozen as `frozen` says."""
    module = "rollout_checkpoint.examples.serve"
    command = [sys.executable, "-m", module, "counter", "--session-secret", "fixed-secret", *extra]
    if frozen is not None:
        command = [sys.executable, "-m", "tests.frozen_storage", frozen, *command[2:]]
    return started(command, env=env, log=log)


def fleet_file(path: Path, root: str, announced: dict[str, str]) -> Path:
    path.write_text(
        f'checkpoint_root = "{root}"\n[[participants]]\nname = "counter"\n'
        f'address = "{announced["grpc"]}"\n'
    )
    return path


def admission_open(fleet: Path, env: dict[str, str]) -> bool:
    status = cli("status", "--fleet", str(fleet), "--json", env=env)
    assert status.returncode == 0, status.stderr
    return '"admission_open": true' in status.stdout


# -- an object store that stopped answering ---------------------------------------------


def test_fleet_verbs_and_inspect_against_a_stopped_s3_server_end_at_their_deadline(
    tmp_path: Path, s3_server: SeaweedS3, url: str
) -> None:
    env = environment()
    process, announced = counter(env)
    try:
        fleet = fleet_file(tmp_path / "fleet.toml", url, announced)
        taken = cli("checkpoint", "--fleet", str(fleet), "ckpt-a", env=env)
        assert taken.returncode == 0, taken.stderr
        with stopped(s3_server):
            results = timed(three_verbs(fleet, url), env, tmp_path)
        for name, result in results.items():
            print(f"{name} against a stopped S3 server: {result[0]:.1f} s, exit {result[1]}")
        for name, result in results.items():
            assert_storage_failed(name, result)
        assert admission_open(fleet, env)  # nothing stayed closed
    finally:
        kill_group(process)


def test_collect_reading_a_stopped_s3_server_ends_at_its_checkpoint_timeout(
    tmp_path: Path, s3_server: SeaweedS3, url: str
) -> None:
    """`collect` reads its `--checkpoint-dir` before it touches the fleet (is a collection
    there already? what did it publish?): a store that does not answer is STORAGE_FAILED
    (exit 4) at `--checkpoint-timeout`, fresh or `--resume`, not a wait on the store
    client's own 120 s timeout, nor a CORRUPT checkpoint."""
    env = environment()
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[participants]]\nname = "counter"\naddress = "127.0.0.1:9"\n')
    tasks = REPO / "examples" / "prompt_injection_tasks.jsonl"

    def collect(*extra: str) -> list[str]:
        return cli_command(
            "collect",
            "--fleet",
            str(fleet),
            "--entry-url",
            "http://127.0.0.1:9",
            "--input",
            str(tasks),
            "--output",
            str(tmp_path / "rollouts.jsonl"),
            "--checkpoint-dir",
            url,
            "--checkpoint-timeout",
            str(TIMEOUT),
            "--json",
            *extra,
        )

    with stopped(s3_server):
        results = timed(
            {"collect": collect(), "collect --resume": collect("--resume")}, env, tmp_path
        )
    for name, result in results.items():
        print(f"{name} against a stopped S3 server: {result[0]:.1f} s, exit {result[1]}")
    for name, result in results.items():
        assert_storage_failed(name, result)


async def test_the_coordinator_and_the_library_end_at_their_deadline_on_a_stopped_s3_server(
    s3_server: SeaweedS3, url: str
) -> None:
    h = await start_harness(clock=SystemClock())  # type: ignore[arg-type]
    try:
        spec = FleetSpec.from_addresses([h.grpc_address], TOKEN, checkpoint_root=url)
        coordinator = Coordinator(spec, "127.0.0.1:0")
        await coordinator.start()
        try:
            async with (
                aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel,
                await Fleet.discover(spec) as fleet,
            ):
                stub = cpb_grpc.CoordinatorServiceStub(channel)
                root = await asyncio.to_thread(open_checkpoint_root, url)
                with stopped(s3_server):
                    began = time.monotonic()
                    with pytest.raises(aio.AioRpcError) as caught:
                        await stub.Restore(
                            cpb.CoordinatorServiceRestoreRequest(
                                checkpoint_id="restore-1",
                                deadline=timestamp(time.time() + TIMEOUT),
                                rejoin=True,
                            ),
                            metadata=AUTH,
                            timeout=GUARD,
                        )
                    restore_seconds = time.monotonic() - began
                    began = time.monotonic()
                    with pytest.raises(aio.AioRpcError) as caught_checkpoint:
                        async for _ in stub.Checkpoint(
                            cpb.CheckpointRequest(deadline=timestamp(time.time() + TIMEOUT)),
                            metadata=AUTH,
                            timeout=GUARD,
                        ):
                            pass
                    checkpoint_seconds = time.monotonic() - began
                    began = time.monotonic()
                    with pytest.raises(StorageFailed):
                        await asyncio.wait_for(
                            restore_published(fleet, root, "restore-2", time.time() + TIMEOUT),
                            GUARD,
                        )
                    library_seconds = time.monotonic() - began
        finally:
            await coordinator.stop()
    finally:
        await stop_harness(h)
    for caught_error, seconds in (
        (caught, restore_seconds),
        (caught_checkpoint, checkpoint_seconds),
    ):
        error = ControlError.from_rpc_error(caught_error.value)
        assert error.reason == "STORAGE_FAILED", error
        assert seconds < TIMEOUT + CALL_MARGIN, seconds
    assert library_seconds < TIMEOUT + CALL_MARGIN, library_seconds


# -- a frozen local filesystem ------------------------------------------------------------


def test_fleet_verbs_and_inspect_on_a_frozen_local_root_end_at_their_deadline(
    tmp_path: Path,
) -> None:
    """The controller's root stalls (every open of it never returns) after the participants
    committed: the publication is abandoned at the deadline, the fleet resumed, and LATEST
    still names the checkpoint before."""
    env = environment()
    root = tmp_path / "root"
    process, announced = counter(env)
    try:
        fleet = fleet_file(tmp_path / "fleet.toml", str(root), announced)
        taken = cli("checkpoint", "--fleet", str(fleet), "ckpt-a", env=env)
        assert taken.returncode == 0, taken.stderr
        results = timed(three_verbs(fleet, str(root), "ckpt-b", frozen="opened"), env, tmp_path)
        for name, result in results.items():
            print(f"{name} on a frozen local root: {result[0]:.1f} s, exit {result[1]}")
        for name, result in results.items():
            assert f"{FROZEN_LINE}opened" in result[3], f"{name} never stalled: {result[3]}"
            assert_storage_failed(name, result)
        assert admission_open(fleet, env)
        assert (root / "LATEST").read_text().strip() == "ckpt-a"
        assert (root / "ckpt-b").is_dir() and not (root / "ckpt-b" / "checkpoint.json").exists()
    finally:
        kill_group(process)


async def test_a_publication_abandoned_at_its_deadline_does_not_publish_when_it_wakes_up(
    tmp_path: Path,
) -> None:
    """The publisher's thread stalls right before the fleet manifest (as on a filesystem
    frozen there): the checkpoint fails STORAGE_FAILED at its deadline and the fleet is
    resumed. When the thread wakes up after that it stops, so neither the fleet manifest nor
    LATEST ever names the checkpoint the caller was told was not taken."""
    thaw = threading.Event()
    stalled = threading.Event()
    stopped_at: list[str] = []

    def stall_before_the_fleet_manifest(step: str) -> None:
        stopped_at.append(step)
        if step == "after_verify":
            stalled.set()
            thaw.wait()

    root = CheckpointRoot(tmp_path / "root", crash_hook=stall_before_the_fleet_manifest)
    h = await start_harness(clock=SystemClock())  # type: ignore[arg-type]
    try:
        h.participant.seed(EpisodeId("r1"), {"n": 1})
        spec = FleetSpec.from_addresses([h.grpc_address], TOKEN)
        async with await Fleet.discover(spec) as fleet:
            began = time.monotonic()
            with pytest.raises(StorageFailed, match="did not answer by the deadline"):
                await asyncio.wait_for(
                    _drain(checkpoint(fleet, root, time.time() + TIMEOUT, checkpoint_id="c1")),
                    GUARD,
                )
            seconds = time.monotonic() - began
            assert stalled.is_set()
            status = await fleet.members[0].client.get_status()
            assert status.admission_open  # aborted: the fleet was resumed
        publisher = [t for t in threading.enumerate() if t.name == "store call: publish"]
        thaw.set()
        for thread in publisher:
            thread.join(timeout=60)
            assert not thread.is_alive()
    finally:
        thaw.set()
        await stop_harness(h)
    assert seconds < TIMEOUT + CALL_MARGIN, seconds
    assert publisher, "the publication did not run on a thread of its own"
    assert stopped_at == ["after_verify"]
    assert not (tmp_path / "root" / "c1" / "checkpoint.json").exists()
    assert not (tmp_path / "root" / "LATEST").exists()


async def _drain(events: object) -> None:
    async for _ in events:  # type: ignore[attr-defined]
        pass


def test_a_participant_whose_part_write_hangs_exits_within_its_grace_after_sigterm(
    tmp_path: Path,
) -> None:
    """The participant's storage thread blocks in the write of its part for good (a hung
    filesystem): SIGTERM still ends the process within the documented shutdown grace. With
    `--workers` the main process (control plane, sidecar) ends its event loop normally, and
    a stuck thread of the loop's default executor was joined there, for ever. (A thread in
    uninterruptible sleep on a *frozen* filesystem holds any process until the thaw: the
    kernel reaps a process only once all its threads left their system calls.)"""
    env = environment()
    log = tmp_path / "participant.log"
    process, announced = counter(env, "--workers", "2", frozen="write_all", log=log)
    committing = None
    try:
        fleet = fleet_file(tmp_path / "fleet.toml", str(tmp_path / "root"), announced)
        committing = start(
            cli_command("checkpoint", "--fleet", str(fleet), "--timeout", "120", "ckpt-a"),
            env=env,
            log=tmp_path / "checkpoint.stderr",
        )
        frozen = f"{FROZEN_LINE}write_all"
        wait_until(lambda: frozen in log.read_text(errors="replace"), frozen, process, 120)
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=SHUTDOWN_GRACE + 45)
        seconds = time.monotonic() - began
        print(f"participant exited {seconds:.1f} s after SIGTERM (code {process.returncode})")
        assert process.returncode is not None, "still alive: the stuck write held it"
        assert seconds < SHUTDOWN_GRACE + PROCESS_MARGIN, seconds
    finally:
        kill_group(process)
        if committing is not None:
            kill_group(committing)
