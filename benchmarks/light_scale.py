"""Benchmark 6: fleet checkpoints of 100, 300 and 1,000 lightweight participants.

The largest fleet is started once, split over `light_hosts` host processes
(`benchmarks.light_fleet`: many real sidecars per process, each its own port and control
plane, over an always-ready participant with a few tiny episodes); a fleet of size S is its
first S members, spread over every host, so the sizes run interleaved round by round on the
same processes. Each round checkpoints every size twice: prepare + commit (unscoped: each
member exports what it holds) + publish + resume through the coordination library and
`client/checkpointing/publication/` in this process (`checkpointing.checkpoint`), then the
same through the CoordinatorService (`rollout-checkpoint coordinator`, its own process; its
Checkpoint RPC). The coordinator's CPU per member is its process CPU time over the checkpoint divided
by the members: this process's for the library, the coordinator process's for the service.
The members' CPU per member is the host processes' over the same checkpoint: on this one
machine every member shares the coordinator's cores, which a real fleet's members do not.
The CPU floor is the coordinator's and the members' CPU over those cores: no pause on this
machine is shorter, so the floor's own 1,000 / 100 ratio bounds the pause's from below.

The ratio is on the fleet's pause, prepare + commit + publish + resume (the issue's figure):
retention runs after the resume and is reported beside it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

from grpc import aio

from rollout_checkpoint.client.checkpointing.checkpoint import checkpoint
from rollout_checkpoint.client.checkpointing.publication import CheckpointRoot
from rollout_checkpoint.client.fleet import DEFAULT_FAN_OUT, Fleet, FleetSpec, MemberSpec
from rollout_checkpoint.client.participant import timestamp
from rollout_checkpoint.v1 import coordinator_service_pb2 as cpb
from rollout_checkpoint.v1 import coordinator_service_pb2_grpc as cpb_grpc

from .common import BenchResult, Processes, Server, deadline_in, ms, now, ratios
from .fleetutil import launch_coordinator

TIMEOUT = 300.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CORES = len(os.sched_getaffinity(0))
"""The cores every process here shares: the coordinator's and the members' CPU, divided by
them, is the shortest pause this one machine allows (the members' CPU grows with the fleet)."""


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux `/proc/<pid>/stat`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start_hosts(processes: Processes, members: int, hosts: int) -> list[Server]:
    """`hosts` light-fleet processes serving members 0 .. `members` - 1 between them."""
    token_file = processes.workdir / "light-token"
    token_file.write_text(processes.token)
    token_file.chmod(0o600)
    servers = []
    for h in range(hosts):
        count = len(range(h, members, hosts))
        argv = ["-m", "benchmarks.light_fleet", "--members", str(count), "--first", str(h)]
        argv += ["--stride", str(hosts), "--token-file", str(token_file)]
        servers.append(processes.launch(f"light-host-{h}", argv))
    return servers


def member_specs(hosts: list[Server]) -> list[MemberSpec]:
    """Every member the hosts announced, in member order (light-0000, light-0001, ...)."""
    named = [MemberSpec(name, address) for h in hosts for name, address in h.announced["members"]]
    return sorted(named, key=lambda m: m.name)


def hosts_cpu_seconds(hosts: list[Server]) -> float:
    """CPU seconds the host processes (every member) used so far."""
    return sum(process_cpu_seconds(h.process.pid) for h in hosts)


async def library_cycle(
    fleet: Fleet, root: CheckpointRoot, hosts: list[Server]
) -> dict[str, float]:
    """One published checkpoint through `checkpointing.checkpoint`; seconds and CPU seconds.

    "resumed" is the fleet's pause (the call until every member answered its Resume);
    retention runs after it, "total" includes it."""
    cpu = time.process_time()
    members_cpu = hosts_cpu_seconds(hosts)
    started = now()
    outcome = None
    async for event in checkpoint(fleet, root, deadline_in(TIMEOUT), scope=None, keep=1):
        outcome = event.outcome if event.final else outcome
    total = now() - started
    cpu = time.process_time() - cpu
    members_cpu = hosts_cpu_seconds(hosts) - members_cpu
    if outcome is None or outcome.published is None or outcome.resumed_seconds is None:
        raise RuntimeError(f"the light fleet checkpoint was not published: {outcome}")
    return {
        "resumed": outcome.resumed_seconds,
        "total": total,
        "prepare": outcome.prepare_seconds,
        "commit": outcome.commit_seconds,
        "publish": outcome.publish_seconds,
        "retention": outcome.retention_seconds,
        "cpu": cpu,
        "members_cpu": members_cpu,
    }


def cpu_floor(timing: dict[str, float]) -> float:
    """Seconds: the CPU a library checkpoint took, coordinator and members, over the cores."""
    return (timing["cpu"] + timing["members_cpu"]) / CORES


async def service_cycle(
    stub: cpb_grpc.CoordinatorServiceStub, metadata: Any, coordinator: Server
) -> dict[str, float]:
    """One published checkpoint through the CoordinatorService's Checkpoint RPC ("resumed":
    the fleet's pause as the coordinator reports it, `CheckpointResult.resumed_after`)."""
    request = cpb.CheckpointRequest(deadline=timestamp(deadline_in(TIMEOUT)))
    cpu = process_cpu_seconds(coordinator.process.pid)
    started = now()
    last = None
    async for message in stub.Checkpoint(request, metadata=metadata, timeout=TIMEOUT):
        last = message
    total = now() - started
    cpu = process_cpu_seconds(coordinator.process.pid) - cpu
    if last is None or last.phase != cpb.CHECKPOINT_PHASE_DONE:
        raise RuntimeError(f"the coordinator's checkpoint did not finish: {last}")
    if not last.result.HasField("resumed_after"):
        raise RuntimeError(f"the coordinator's checkpoint did not resume the fleet: {last}")
    resumed = last.result.resumed_after.ToTimedelta().total_seconds()
    return {"resumed": resumed, "total": total, "cpu": cpu}


async def run(ctx: Any) -> BenchResult:
    params = ctx.params
    processes: Processes = ctx.processes
    sizes = sorted(params.light_sizes)
    fan_out = params.fan_out or DEFAULT_FAN_OUT
    result = BenchResult(
        "light",
        "6. Fleet of lightweight participants (prepare + commit + publish + resume)",
        f"{sizes[-1]} real sidecars (each its own port and control plane, over an always-ready "
        f"participant with a few tiny episodes) in {params.light_hosts} host processes; a "
        "fleet of S is its first S members. Each round checkpoints every size through the "
        "coordination library + publication in the benchmark process, then through the "
        "CoordinatorService (its own process); unscoped commits. The checkpoint is the "
        "fleet's pause: from the call until every member answered its Resume; retention "
        "(keep 1: the previous checkpoint is deleted) runs after it. Coordinator CPU per "
        "member: the coordinator process's CPU time over the checkpoint / members; members' "
        "CPU per member: the host processes' (on the same cores). Fan-out bound per stage: "
        f"{fan_out} calls at once.",
        params={
            "sizes": sizes,
            "hosts": params.light_hosts,
            "repeats": params.repeats,
            "fan_out": fan_out,
        },
    )
    ctx.say(f"light: starting {sizes[-1]} sidecars in {params.light_hosts} processes")
    hosts = await asyncio.to_thread(start_hosts, processes, sizes[-1], params.light_hosts)
    specs = member_specs(hosts)
    fleets: dict[int, Fleet] = {}
    coordinators: dict[int, Server] = {}
    channels: list[aio.Channel] = []
    metadata = (("authorization", f"Bearer {processes.token}"),)
    library: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    service: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    work = ctx.workdir / "light-checkpoints"
    try:
        stubs = {}
        for size in sizes:
            spec = FleetSpec(members=tuple(specs[:size]), token=processes.token, fan_out=fan_out)
            fleets[size] = await Fleet.discover(spec)
            root = work / f"service-{size}"
            root.mkdir(parents=True, exist_ok=True)
            coordinators[size] = await asyncio.to_thread(
                launch_coordinator,
                processes,
                specs[:size],
                f"light-coord-{size}",
                [f'checkpoint_root = "{root}"', "keep = 1", f"fan_out = {fan_out}"],
            )
            channels.append(aio.insecure_channel(coordinators[size].grpc or ""))
            stubs[size] = cpb_grpc.CoordinatorServiceStub(channels[-1])
        roots = {size: CheckpointRoot(work / f"library-{size}") for size in sizes}
        for repeat in range(-1, params.repeats):  # round -1 warms every channel, unmeasured
            if repeat >= 0:
                ctx.say(f"light: round {repeat + 1}/{params.repeats}")
            for size in sizes:
                timing = await library_cycle(fleets[size], roots[size], hosts)
                served = await service_cycle(stubs[size], metadata, coordinators[size])
                if repeat >= 0:
                    library[size].append(timing)
                    service[size].append(served)
    finally:
        await asyncio.gather(*(f.close() for f in fleets.values()))
        await asyncio.gather(*(c.close() for c in channels))
        processes.stop_servers([*coordinators.values(), *hosts])
        shutil.rmtree(work, ignore_errors=True)
    phases = {
        "resumed": "library: checkpoint (prepare + commit + publish + resume)",
        "prepare": "library: of which prepare",
        "commit": "library: of which commit",
        "publish": "library: of which publish",
        "retention": "library: retention, after the resume",
        "total": "library: the whole call (with retention)",
    }
    for size in sizes:
        label = f"{size} members"
        for phase, metric in phases.items():
            result.figure(label, metric, "ms", [ms(t[phase]) for t in library[size]])
        result.figure(
            label,
            "library: coordinator CPU per member",
            "µs",
            [t["cpu"] / size * 1e6 for t in library[size]],
        )
        result.figure(
            label,
            "library: members' CPU per member (the host processes, same 2 cores)",
            "µs",
            [t["members_cpu"] / size * 1e6 for t in library[size]],
        )
        result.figure(
            label,
            f"library: CPU floor, (coordinator + members' CPU) / {CORES} cores",
            "ms",
            [cpu_floor(t) * 1e3 for t in library[size]],
            note="the shortest pause these cores allow for the CPU the checkpoint took",
        )
        result.figure(
            label,
            "service: checkpoint (prepare + commit + publish + resume)",
            "ms",
            [ms(t["resumed"]) for t in service[size]],
        )
        result.figure(
            label, "service: the whole call", "ms", [ms(t["total"]) for t in service[size]]
        )
        result.figure(
            label,
            "service: coordinator CPU per member",
            "µs",
            [t["cpu"] / size * 1e6 for t in service[size]],
        )
    smallest = sizes[0]
    for size in sizes[1:]:
        for name, timings in (("library", library), ("service", service)):
            result.ratio(
                f"{size} / {smallest} members ({name}: prepare + commit + publish + resume)",
                f"{size} {name} checkpoint",
                f"{smallest} {name} checkpoint",
                ratios(
                    [t["resumed"] for t in timings[size]],
                    [t["resumed"] for t in timings[smallest]],
                ),
            )
        result.ratio(
            f"{size} / {smallest} members (library: CPU floor)",
            f"{size} library CPU floor",
            f"{smallest} library CPU floor",
            ratios(
                [cpu_floor(t) for t in library[size]],
                [cpu_floor(t) for t in library[smallest]],
            ),
            note="the pause's ratio cannot go below this on one machine",
        )
        result.ratio(
            f"{size} / {smallest} members (library: coordinator CPU per member)",
            f"{size} coordinator CPU per member",
            f"{smallest} coordinator CPU per member",
            ratios(
                [t["cpu"] / size for t in library[size]],
                [t["cpu"] / smallest for t in library[smallest]],
            ),
        )
    return result
