"""What completion receipts and the result outbox cost, and what they save (issue 37).

    python -m benchmarks.receipts [--scale tiny]

One invocation, one JSON line on stdout, nothing written into the repository (checkpoints and
server logs go to a temporary directory, removed at the end). Three measures:

1. *Receipts on `/run`*: a small entry app on the library's `EpisodeParticipant` whose `/run`
   answers a ~4 KB JSON result (a short transcript), called directly as an ASGI app (no socket,
   no sidecar) through the rollout prefix, with and without `x-rollout-receipt: request`,
   alternating round by round in this process, timed by `time.process_time()` (CPU). The
   receipted side acknowledges its held results in process, 100 at a time, inside the timed
   loop (the outbox stays bounded and the release is counted), each receipt read back from
   its reply header as a trainer would.
2. *Checkpoint bytes of held results*: the same app served on 127.0.0.1:0 with its sidecar;
   a real Prepare + Commit (scope=[]) to a temporary directory, empty and then with N held
   results of the same size; the part's bytes (`CommitResponse.manifest.bytes`).
3. *Re-offering vs recomputing*: 1,000 held results committed; a fresh app served started
   closed; Restore + `all_results()` (the trainer's whole recovery of them) timed per round.
   The recompute side is the example fleet's real rollouts (environment -> agent -> scripted
   policy model at its default latency + prompt-injection resources server, one process
   each): a small sample at a fixed concurrency gives rollouts per second, from which the time
   to recompute 1,000 at that concurrency is extrapolated (stated as such in the output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.episodic.episode_participant import EpisodeParticipant
from rollout_checkpoint.server.runtime.install import CheckpointRuntime, install_checkpointing
from rollout_checkpoint.server.runtime.participant import Kind
from rollout_checkpoint.server.runtime.result_outbox import Receipt, ResultOutbox
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import types_pb2

from .asgi_overhead import call
from .common import Processes, deadline_in, ratios, spread
from .fleetutil import start_groups

TOKEN = "r" * 32
ASK = ((b"x-rollout-receipt", b"request"),)
ACK_BATCH = 100
REAL_ROLLOUT_SECONDS = 2.0
REAL_MODEL_CALL_SECONDS = 0.5
RECOVERED = 1_000
"""Results committed unacknowledged, then recovered after a restore (measure 3)."""

SCALES: dict[str, dict[str, int]] = {
    "default": {
        "requests": 2000,
        "rounds": 10,
        "held": 10_000,
        "restore_rounds": 5,
        "rollouts": 8,
        "concurrency": 4,
        "fleet_rounds": 6,
    },
    "tiny": {
        "requests": 300,
        "rounds": 4,
        "held": 1_000,
        "restore_rounds": 2,
        "rollouts": 4,
        "concurrency": 4,
        "fleet_rounds": 2,
    },
}


def transcript(rollout_id: str) -> dict[str, Any]:
    """A realistic ~4 KB result: a short agent transcript with a reward."""
    turns = []
    for turn in range(6):
        turns.append({"role": "user", "content": f"Step {turn} of {rollout_id}: " + "q" * 260})
        turns.append(
            {
                "role": "assistant",
                "content": "Looking at the record. " + "a" * 230,
                "tool_calls": [{"name": "read_chart", "arguments": {"patient": f"P10{turn:02d}"}}],
            }
        )
    return {"rollout": rollout_id, "reward": 0.75, "finish_reason": "stop", "messages": turns}


RESULT_BYTES = len(json.dumps(transcript("bench-0000000"), separators=(",", ":")).encode())


@dataclass
class Entry:
    """An entry server on `EpisodeParticipant` whose `/run` answers a transcript."""

    settings: CheckpointSettings
    participant: EpisodeParticipant = field(
        default_factory=lambda: EpisodeParticipant(Kind.AGENT, "bench-entry")
    )
    runtime: CheckpointRuntime | None = None

    def app(self) -> Starlette:
        async def run(request: Request) -> JSONResponse:
            episode = episode_of(request.scope)
            assert episode is not None
            tracker = self.participant.episodes_tracker
            tracked, _ = tracker.begin(episode)
            try:
                await request.body()
                result = transcript(episode.rollout_id)
                tracker.finish(tracked, {"done": True})
                return JSONResponse(result)
            finally:
                tracker.end(tracked)

        app = Starlette(routes=[Route("/run", run, methods=["POST"])])
        app.add_middleware(RolloutPrefixMiddleware)
        self.runtime = install_checkpointing(app, self.participant, self.settings)
        return app

    @property
    def outbox(self) -> ResultOutbox:
        assert self.participant.outbox is not None
        return self.participant.outbox


def receipt_of(reply: list[dict[str, Any]]) -> Receipt:
    headers = dict(reply[0]["headers"])
    return Receipt.from_json(json.loads(headers[b"x-rollout-receipt"]))


async def run_once(app: Any, rollout_id: str, receipted: bool) -> list[dict[str, Any]]:
    reply = await call(app, f"/ng-rollout/{rollout_id}/run", b"{}", ASK if receipted else ())
    if reply[0]["status"] != 200:
        raise RuntimeError(f"/run of {rollout_id} answered {reply[0]['status']}")
    return reply


async def fill(entry: Entry, app: Any, count: int, tag: str) -> None:
    """`count` receipted runs through the app, their results left held."""
    for index in range(count):
        await run_once(app, f"{tag}{index:07d}", True)
    assert len(entry.outbox) >= count


# -- 1. receipts on /run --------------------------------------------------------------------


async def cpu_per_run(entry: Entry, app: Any, tag: str, requests: int, receipted: bool) -> float:
    """Microseconds of this process's CPU per `/run` (acknowledgements included)."""
    pending: list[Receipt] = []
    for index in range(requests // 10):  # warm-up
        reply = await run_once(app, f"w{tag}{index:07d}", receipted)
        if receipted:
            pending.append(receipt_of(reply))
    entry.outbox.acknowledge(pending)
    pending.clear()
    started = time.process_time()
    for index in range(requests):
        reply = await run_once(app, f"{tag}{index:07d}", receipted)
        if receipted:
            pending.append(receipt_of(reply))
            if len(pending) == ACK_BATCH:
                entry.outbox.acknowledge(pending)
                pending.clear()
    if pending:
        entry.outbox.acknowledge(pending)
    spent = time.process_time() - started
    if len(entry.outbox):
        raise RuntimeError(f"{len(entry.outbox)} results still held after acknowledging")
    return spent / requests * 1e6


async def receipts_on_run(requests: int, rounds: int) -> dict[str, list[float]]:
    entry = Entry(CheckpointSettings(enabled=True, token=TOKEN))
    app = entry.app()
    results: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(rounds):
        order = ("with", "without") if round_ % 2 == 0 else ("without", "with")
        for variant in order:
            tag = f"{variant[0]}{round_}x"
            results[variant].append(await cpu_per_run(entry, app, tag, requests, variant == "with"))
    return results


# -- serving --------------------------------------------------------------------------------


class StartedServer(uvicorn.Server):
    """uvicorn's server with an event for "started" (lifespan done, sockets bound)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.started_event.set()


@dataclass
class Served:
    entry: Entry
    app: Starlette
    client: ParticipantClient
    server: StartedServer
    serving: asyncio.Future[None]

    async def close(self) -> None:
        await self.client.close()
        self.server.should_exit = True
        await self.serving


async def serve_entry(**settings: Any) -> Served:
    """The entry app under uvicorn on 127.0.0.1:0 with its sidecar; returns once it listens."""
    entry = Entry(CheckpointSettings(enabled=True, token=TOKEN, **settings))
    app = entry.app()
    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    server = StartedServer(config)
    serving = asyncio.ensure_future(server.serve())
    started = asyncio.ensure_future(server.started_event.wait())
    await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        serving.result()
        raise RuntimeError("the entry app stopped during startup")
    assert entry.runtime is not None
    return Served(entry, app, ParticipantClient(entry.runtime.address, TOKEN), server, serving)


@dataclass(frozen=True)
class Committed:
    part_bytes: int
    commit_seconds: float
    """Wall time of the Commit RPC alone (the part written and synced)."""


async def commit(served: Served, checkpoint_id: str, directory: Path) -> Committed:
    """Prepare + Commit (scope=[]) + Resume."""
    final = await served.client.prepare_until_final(checkpoint_id, deadline_in(120))
    if final.state != types_pb2.PARTICIPANT_STATE_PREPARED:
        raise RuntimeError(f"Prepare {checkpoint_id} did not reach PREPARED: {final}")
    started = time.perf_counter()
    committed = await served.client.commit(checkpoint_id, deadline_in(300), str(directory), [])
    spent = time.perf_counter() - started
    await served.client.resume(checkpoint_id, deadline_in(60))
    return Committed(int(committed.manifest.bytes), spent)


# -- 2. checkpoint bytes --------------------------------------------------------------------


async def checkpoint_bytes(held: int, work: Path) -> dict[str, Any]:
    served = await serve_entry(outbox_cap=max(held, 1))
    try:
        empty = await commit(served, "empty", work / "bytes-empty")
        await fill(served.entry, served.app, held, "h")
        raw = sum(len(h.canonical.encode()) for h in served.entry.outbox.results())
        full = await commit(served, "full", work / "bytes-full")
    finally:
        await served.close()
    added = full.part_bytes - empty.part_bytes
    return {
        "held_results": held,
        "result_bytes_each_mean": raw / held,
        "raw_result_bytes": raw,
        "part_bytes_empty": empty.part_bytes,
        "part_bytes_with_held": full.part_bytes,
        "commit_seconds_empty": empty.commit_seconds,
        "commit_seconds_with_held": full.commit_seconds,
        "bytes_added_per_result": added / held,
        "overhead_over_raw_result_bytes": added / raw,
        "note": "one commit each (bytes do not vary between runs); scope=[] so only the "
        "outbox is exported (the empty commit's manifest reports its bytes); raw = the held "
        "results' canonical JSON",
    }


# -- 3. re-offering after a restore vs recomputing -------------------------------------------


async def committed_outbox(work: Path) -> Path:
    directory = work / "recovered"
    served = await serve_entry()
    try:
        await fill(served.entry, served.app, RECOVERED, "k")
        await commit(served, "kept", directory)
    finally:
        await served.close()
    return directory


async def recover(directory: Path, round_: int) -> tuple[float, float]:
    """Wall seconds of Restore, then of all_results(), in a fresh app started closed."""
    served = await serve_entry(start_closed=True)
    try:
        started = time.perf_counter()
        await served.client.restore(f"back-{round_}", deadline_in(120), str(directory), [])
        restored = time.perf_counter()
        offered = await served.client.all_results()
        listed = time.perf_counter()
        if len(offered) != RECOVERED:
            raise RuntimeError(f"restored {len(offered)} results, expected {RECOVERED}")
        return restored - started, listed - restored
    finally:
        await served.close()


async def fleet_rollouts(
    work: Path, rollouts: int, concurrency: int, rounds: int
) -> dict[str, Any]:
    """Real rollouts of the example fleet through `/run`, `concurrency` at a time, in
    rounds alternating with and without `x-rollout-receipt: request` (each round its own
    rollout ids; the receipted round's results acknowledged after its timed window, as a
    trainer does in the background): /run throughput with and without receipts."""
    processes = Processes(work / "fleet", secrets.token_hex(16))
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    try:
        group = (await start_groups(processes, 1))[0]
        tasks = load_tasks()
        assert group.environment.grpc is not None
        async with (
            httpx.AsyncClient(base_url=group.environment.url, timeout=120) as http,
            ParticipantClient(group.environment.grpc, processes.token) as control,
        ):

            async def one(rollout_id: str, index: int, headers: dict[str, str]) -> None:
                body = {"task": tasks[index % len(tasks)]}
                reply = await http.post(f"/ng-rollout/{rollout_id}/run", json=body, headers=headers)
                if reply.status_code != 200:
                    raise RuntimeError(f"{rollout_id}: {reply.status_code} {reply.text[:200]}")

            async def timed_round(tag: str, receipted: bool) -> float:
                queue = list(range(rollouts))
                headers = {"x-rollout-receipt": "request"} if receipted else {}

                async def worker() -> None:
                    while queue:
                        index = queue.pop()
                        await one(f"bench-{tag}-{index}", index, headers)

                started = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                spent = time.perf_counter() - started
                held = await control.all_results()
                if held:
                    await control.acknowledge_results([h.receipt for h in held], time.time() + 30)
                return spent

            await one("bench-warm-up", 0, {})  # connections, first-call imports
            for round_ in range(rounds):
                for receipted in (round_ % 2 == 0, round_ % 2 == 1):
                    tag = f"{'r' if receipted else 'p'}{round_}"
                    seconds["with" if receipted else "without"].append(
                        await timed_round(tag, receipted)
                    )
    finally:
        processes.close()
    return {"rollouts": rollouts, "concurrency": concurrency, "seconds": seconds}


# -- the report -----------------------------------------------------------------------------


def run_report(cpu: dict[str, list[float]]) -> dict[str, Any]:
    added = [w - wo for w, wo in zip(cpu["with"], cpu["without"], strict=True)]
    return {
        "cpu_us_per_run_with_receipt": spread(cpu["with"]),
        "cpu_us_per_run_without_receipt": spread(cpu["without"]),
        "ratio_with_over_without": spread(ratios(cpu["with"], cpu["without"])),
        "added_cpu_us_per_run": spread(added),
        "added_share_of_a_2s_rollout": statistics.median(added) / 1e6 / REAL_ROLLOUT_SECONDS,
        "note": "CPU (process_time) per /run of a ~4 KB transcript, in process, no socket; "
        "the receipted side includes reading its receipt header and acknowledging in "
        f"batches of {ACK_BATCH}. ratio_with_over_without is the cost on an entry whose /run "
        "does nothing else (the worst case); added_share_of_a_2s_rollout is NOT measured: "
        "the median added CPU divided by a hypothetical rollout of 2 s wall time "
        f"({REAL_ROLLOUT_SECONDS / REAL_MODEL_CALL_SECONDS:.0f} model calls of "
        f"{REAL_MODEL_CALL_SECONDS} s)",
    }


async def run(scale: str) -> dict[str, Any]:
    sizes = SCALES[scale]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-receipts-") as name:
        work = Path(name)
        cpu = await receipts_on_run(sizes["requests"], sizes["rounds"])
        sized = await checkpoint_bytes(sizes["held"], work)
        directory = await committed_outbox(work)
        phases = [await recover(directory, r) for r in range(sizes["restore_rounds"])]
        fleet = await fleet_rollouts(
            work, sizes["rollouts"], sizes["concurrency"], sizes["fleet_rounds"]
        )
    recoveries = [restore + listing for restore, listing in phases]
    plain = statistics.median(fleet["seconds"]["without"])
    per_second = fleet["rollouts"] / plain
    recompute = RECOVERED / per_second
    run_part = run_report(cpu)
    run_part["added_share_of_a_measured_fleet_rollout_note"] = (
        "the median added CPU over the example fleet's measured wall seconds per rollout "
        "(its sample's seconds / rollouts, at its concurrency): a fast scripted model"
    )
    run_part["added_share_of_a_measured_fleet_rollout"] = (
        run_part["added_cpu_us_per_run"]["median"] / 1e6 / (plain / fleet["rollouts"])
    )
    run_part["fleet_run_throughput"] = {
        "seconds_with_receipts": spread(fleet["seconds"]["with"]),
        "seconds_without": spread(fleet["seconds"]["without"]),
        "throughput_without_over_with": spread(
            ratios(fleet["seconds"]["with"], fleet["seconds"]["without"])
        ),
        "note": f"the example fleet, {fleet['rollouts']} rollouts a round at concurrency "
        f"{fleet['concurrency']}, rounds with and without receipts interleaved; "
        "throughput_without_over_with above 1 is what receipts cost (goal <= 1.03)",
    }
    return {
        "benchmark": "receipts",
        "scale": scale,
        "params": {**sizes, "recovered": RECOVERED, "result_bytes": RESULT_BYTES},
        "receipts_on_run": run_part,
        "checkpoint_bytes": sized,
        "recovery": {
            "restore_and_list_seconds": spread(recoveries),
            "restore_seconds": spread([restore for restore, _ in phases]),
            "list_seconds": spread([listing for _, listing in phases]),
            "fleet_measured": {
                "rollouts": fleet["rollouts"],
                "concurrency": fleet["concurrency"],
                "seconds": plain,
                "rollouts_per_second": per_second,
            },
            "recompute_seconds_extrapolated": recompute,
            "recompute_over_recovery": [recompute / r for r in recoveries],
            "recompute_over_recovery_median": recompute / statistics.median(recoveries),
            "note": f"measured: Restore of a part holding {RECOVERED} held ~4 KB results into "
            "a fresh served entry app started closed, then ListResults to the end "
            "(all_results), wall time per round; and the example fleet's wall time for "
            f"{fleet['rollouts']} rollouts through the environment's /run at concurrency "
            f"{fleet['concurrency']} (scripted policy model at its default latency). "
            f"extrapolated: {RECOVERED} rollouts at that rate and concurrency",
        },
        "loadavg": os.getloadavg(),
        "seconds": round(time.perf_counter() - began, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.receipts")
    parser.add_argument("--scale", choices=sorted(SCALES), default="default")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args.scale))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
