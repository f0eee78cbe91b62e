"""Incremental checkpoints through a whole fleet (issue 31): the example resources servers
declare `checkpoint_incremental`, so every fleet of them writes chained parts.

Real processes throughout (the example fleet, `collect` and the coordinator as CLI processes,
a member SIGKILLed and its replacement started closed on the same addresses). One collection
with periodic checkpoints long enough for chains to form, a resources member killed mid-run
and recovered in place: every rollout once, with the uninterrupted run's trajectory, and
published parts that reference earlier ones (read by `inspect`). Then the coordinator restores
the run's longest chain end into a fresh fleet and checkpoints it twice with nothing run in
between: a full part (the first after a Restore) and a chained one of the same cut. Each is
restored by the coordinator into a fresh fleet, and the two fleets' next (full) checkpoints hold
the same records files, byte for byte: a restore from the end of a chain installs exactly what
a full part of the same cut would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpc import aio

from rollout_checkpoint.client.cli.console import ExitCode
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.server.core.rpc.wire import timestamp as stamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from . import test_collect
from .processes import kill_group, started
from .test_collect import CLI, ENV, TOKEN, Baseline, Fleets, RealFleet, latest, wait_until
from .test_collect_recovery import assert_exactly_once_as_the_baseline, replace, stopped

pool, fleets, baseline = test_collect.pool, test_collect.fleets, test_collect.baseline
"""`test_collect`'s fleets (booted ahead in the background) and uninterrupted run."""
MODEL_LATENCY = 1.0
"""Seconds per scripted model call: twice the checkpoint period, so a checkpoint finds some
sessions untouched since the last one (each waits on the model), and references them."""
RESOURCES = ("prompt_injection", "counter")
"""The example fleet's resources members: the incremental ones."""
COORDINATOR_ENV = dict(ENV, ROLLOUT_CHECKPOINT_TOKEN=TOKEN)
METADATA = (("authorization", f"Bearer {TOKEN}"),)
RPC_SECONDS = 90.0


def inspected(directory: Path) -> dict[str, dict[str, Any]]:
    """`rollout-checkpoint inspect DIR --json`: member name -> its part's entry (with
    `own_records`, `referenced_records`, `chain_length` for a chained part)."""
    shown = subprocess.run(
        [*CLI, "inspect", str(directory), "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    return {p["name"]: p for p in json.loads(shown.stdout)["participants"]}


def chained_resources(root: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """checkpoint id -> the resources members whose part references earlier parts, of every
    published checkpoint under `root`."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for manifest in sorted(root.glob("*/checkpoint.json")):
        parts = inspected(manifest.parent)
        chained = {
            name: part
            for name, part in parts.items()
            if name in RESOURCES and part.get("chain_length", 1) > 1
        }
        if chained:
            found[manifest.parent.name] = chained
    return found


def coordinator_fleet(fleet: RealFleet, root: Path) -> Path:
    """The fleet's file for a coordinator that keeps every checkpoint under `root`."""
    file = fleet.file.with_name(f"{fleet.file.stem}-coordinated.toml")
    header = f'checkpoint_root = "{root}"\nkeep = 1000\n'
    file.write_text(header + fleet.file.read_text())
    return file


@contextmanager
def coordinator(fleet: RealFleet, root: Path) -> Iterator[str]:
    """A coordinator process for `fleet` over `root`; its gRPC address."""
    process, announced = started(
        [*CLI, "coordinator", "--fleet", str(coordinator_fleet(fleet, root))],
        "the coordinator",
        env=COORDINATOR_ENV,
    )
    try:
        yield announced["grpc"]
    finally:
        kill_group(process)


async def restore(address: str, checkpoint_id: str, source: str) -> list[str]:
    """Restore `source` into the (fresh) fleet, then resume it; the members' names."""
    async with aio.insecure_channel(address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        restored = await stub.Restore(
            cpb.CoordinatorServiceRestoreRequest(
                checkpoint_id=checkpoint_id,
                source_checkpoint_id=source,
                deadline=stamp(time.time() + RPC_SECONDS),
            ),
            metadata=METADATA,
            timeout=RPC_SECONDS,
        )
        assert restored.source_checkpoint_id == source
        await stub.Resume(
            cpb.CoordinatorServiceResumeRequest(
                checkpoint_id=checkpoint_id, deadline=stamp(time.time() + RPC_SECONDS)
            ),
            metadata=METADATA,
            timeout=RPC_SECONDS,
        )
        return [m.name for m in restored.members]


async def checkpoint(address: str, *checkpoint_ids: str) -> None:
    """Checkpoint the fleet's live episodes once per id, in order (nothing runs on it in
    between)."""
    async with aio.insecure_channel(address) as channel:
        stub = cpb_grpc.CoordinatorServiceStub(channel)
        for checkpoint_id in checkpoint_ids:
            request = cpb.CheckpointRequest(
                checkpoint_id=checkpoint_id,
                deadline=stamp(time.time() + RPC_SECONDS),
                derive_scope=True,
            )
            messages = [
                m async for m in stub.Checkpoint(request, metadata=METADATA, timeout=RPC_SECONDS)
            ]
            assert messages[-1].result.published, messages[-1]


def records_files(directory: Path) -> dict[str, bytes]:
    """kind/instance -> the bytes of that part's records file (full parts only)."""
    files: dict[str, bytes] = {}
    for part in sorted((directory / "participants").glob("*/*")):
        (records,) = part.glob("records-*.jsonl")
        files[f"{part.parent.name}/{part.name}"] = records.read_bytes()
    return files


def resolved(directory: Path, kind: str, instance: str) -> list[dict[str, Any]]:
    """A part's records as a restore installs them (references resolved and verified)."""
    _, records = LocalStorage().read_part(str(directory), kind, instance, lambda _record: True)
    return records


def test_an_incremental_fleet_recovers_a_killed_member_and_its_chain_end_restores_as_a_full_part(
    fleets: Fleets, baseline: Baseline
) -> None:
    work = fleets.work
    root = work / "checkpoints"
    fleet = fleets.start(latency=MODEL_LATENCY).result()
    fresh = [fleets.start(closed=True) for _ in range(3)]
    extra = ["--checkpoint-every", "0.5", "--keep", "1000", "--max-attempts", "1"]
    process = fleets.collect(fleet, *extra, stop_at="after_latest@4")
    wait_until(lambda: stopped(process), "the collector stopped after its checkpoint", process)
    manifest = latest(work)
    assert manifest is not None
    replace(
        fleet, "prompt_injection", "replacement", lambda: os.killpg(process.pid, signal.SIGCONT)
    )
    assert process.wait(timeout=120) == ExitCode.OK, fleets.log(process)
    assert f"recovered in place from checkpoint {manifest['checkpoint_id']}" in fleets.log(process)
    assert_exactly_once_as_the_baseline(work, baseline)

    chains = chained_resources(root)
    assert chains, "no published part of a resources member references an earlier one"
    assert any(
        part["referenced_records"] > 0 for parts in chains.values() for part in parts.values()
    ), chains
    chain_end = max(chains, key=lambda c: max(p["chain_length"] for p in chains[c].values()))
    shape = {
        c: [
            (n, p["chain_length"], p["own_records"], p["referenced_records"]) for n, p in ps.items()
        ]
        for c, ps in chains.items()
    }
    print(f"chained (member, chain length, own, referenced): {shape}; chain end {chain_end}")

    # The chain end restored into a fresh fleet, then two checkpoints with nothing run
    # between them: the first after a Restore is full, the second (same cut) references it.
    with coordinator(fresh[0].result(), root) as address:
        asyncio.run(restore(address, "restore-chain-end", chain_end))
        asyncio.run(checkpoint(address, "same-cut-full", "same-cut-chained"))
    # Every prompt_injection session references the full part (the example tasks never
    # seed the counter: it holds none).
    chained = inspected(root / "same-cut-chained")["prompt_injection"]
    assert chained["chain_length"] == 2, chained
    assert chained["referenced_records"] == chained["record_count"] > 0, chained
    for name in RESOURCES:
        kind, instance = "resources", name
        assert resolved(root / "same-cut-chained", kind, instance) == resolved(
            root / "same-cut-full", kind, instance
        ), name

    # Each restored by the coordinator into a fresh fleet, whose next checkpoint (full: the
    # first after a Restore) writes the state the restore installed.
    for fleet_future, source in zip(fresh[1:], ("same-cut-chained", "same-cut-full"), strict=True):
        with coordinator(fleet_future.result(), root) as address:
            asyncio.run(restore(address, f"restore-{source}", source))
            asyncio.run(checkpoint(address, f"after-{source}"))
    from_chain = records_files(root / "after-same-cut-chained")
    from_full = records_files(root / "after-same-cut-full")
    assert from_chain == from_full
    assert any(from_chain[f"resources/{name}"].strip() for name in RESOURCES), "no session held"
