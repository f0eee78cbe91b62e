"""Incremental parts of the policy model, the agent and the environment (issue 31).

Every server is real (uvicorn on 127.0.0.1:0 in the test loop, its own gRPC sidecar); the
controller's calls are real Prepare / Commit / Resume / Restore RPCs into sibling
directories of one root. A participant's opt-in is switched per checkpoint (`incremental`),
so one cut can be committed twice, incremental and full. The properties:

* an incremental part reads back exactly as the full part of the same cut, and a Restore of
  each into fresh servers installs the same state (the restored servers' own full parts are
  the same bytes);
* only the records something changed are stored again (a delivered reply, a recorded
  boundary, a new episode); the others are referenced;
* a change after the cut of an asynchronous write stays changed;
* the first part after a Restore is full;
* a ledger exported with a generation cut is stored again once the cut is gone (its call
  ended or the checkpoint resumed), never referenced with the cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.examples.policy_model import GatePoint
from rollout_checkpoint.examples.prompt_injection import load_tasks
from rollout_checkpoint.server.core import layout
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.part_storage import LocalStorage
from rollout_checkpoint.v1 import participant_service_pb2 as pb

from .test_fleet_episodes import InProcessFleet, deadline, in_process_fleet
from .test_generation_cuts import Model, TokenGate, final_call, model
from .test_policy_model import CLINIC, after, chat, rollouts

MODEL = ("model", "policy_model")
AGENT = ("agent", "agent")
ENVIRONMENT = ("environment", "environment")


def manifest_of(directory: Path, kind: str, instance: str) -> dict[str, Any]:
    path = Path(layout.part_path(str(directory), kind, instance)) / "manifest.json"
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def read_records(directory: Path, kind: str, instance: str) -> list[dict[str, Any]]:
    """The part's records as a restore reads them (references resolved and verified)."""
    return LocalStorage().read_part(str(directory), kind, instance, lambda r: True)[1]


def records_bytes(directory: Path, kind: str, instance: str) -> bytes:
    """The records file of a full part, as written."""
    part = Path(layout.part_path(str(directory), kind, instance))
    manifest = manifest_of(directory, kind, instance)
    assert manifest["schema_version"] == 1, "a full part"
    return (part / manifest["records_file"]).read_bytes()


# -- the policy model ---------------------------------------------------------------------------


class FailingGate(TokenGate):
    """A token gate whose released generations fail (the backend raised): the call ends
    without delivering anything."""

    async def __call__(self, point: GatePoint) -> None:
        held = self.holds.get((point.rollout_id, point.token)) if point.phase == "token" else None
        await super().__call__(point)
        if held is not None:
            raise RuntimeError("the backend failed")


class ModelRounds:
    """One model server, its rollouts' conversations, and its checkpoints."""

    def __init__(self, m: Model, root: Path, names: Sequence[str]) -> None:
        self.m = m
        self.root = root
        self.bodies = {name: chat(CLINIC) for name in names}
        self.taken = 0

    @property
    def scope(self) -> list[EpisodeId]:
        return [EpisodeId.from_capture_key(name) for name in self.bodies]

    async def deliver(self, name: str) -> None:
        """One more call of `name` delivered: its ledger grows by a row."""
        body = self.bodies[name]
        reply = await self.m.http.post(f"/ng-rollout/{name}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        self.bodies[name] = chat(CLINIC, after(body["messages"], reply))

    async def checkpoint(self, *, full: bool = False, asynchronous: bool = False) -> Path:
        """Prepare, commit every rollout into a new sibling directory, resume; `full` commits
        this cut as a full part."""
        self.taken += 1
        checkpoint_id = f"c{self.taken}"
        directory = self.root / checkpoint_id
        await self.commit(checkpoint_id, directory, full=full, asynchronous=asynchronous)
        await self.m.client.resume(checkpoint_id, self.m.deadline())
        if asynchronous:
            durable = await self.m.client.await_part(checkpoint_id, self.m.deadline())
            assert durable.state == pb.PART_WRITE_STATE_DURABLE
        return directory

    async def commit(
        self, checkpoint_id: str, directory: Path, *, full: bool = False, asynchronous: bool = False
    ) -> None:
        await self.m.prepared(checkpoint_id)
        participant = self.m.participant
        participant.incremental = not full
        try:
            await self.m.client.commit(
                checkpoint_id,
                self.m.deadline(),
                str(directory),
                self.scope,
                asynchronous=asynchronous,
            )
        finally:
            participant.incremental = True


async def delivered_once(m: Model, root: Path, names: Sequence[str]) -> ModelRounds:
    """The model made incremental, with one delivered call in each rollout's ledger."""
    m.participant.incremental = True
    rounds = ModelRounds(m, root, names)
    for name in names:
        await rounds.deliver(name)
    return rounds


async def restored_model_part(source: Path, root: Path, names: Sequence[str]) -> bytes:
    """Restore `source` into a fresh model and commit it: the records file of that part
    (full, the first after a Restore), which holds exactly what the Restore installed."""
    async with model() as fresh:
        fresh.participant.incremental = True
        scope = [EpisodeId.from_capture_key(n) for n in names]
        await fresh.client.restore("restore-1", fresh.deadline(), str(source), scope)
        await fresh.client.resume("restore-1", fresh.deadline())
        root.mkdir()
        rounds = ModelRounds(fresh, root, [f"{n}-a1" for n in names])
        rounds.taken = 100
        first = await rounds.checkpoint()
        # Nothing changed since: the second part references every restored ledger.
        second = manifest_of(await rounds.checkpoint(), *MODEL)
        assert (second["own_records"], second["referenced_records"]) == (0, len(names))
        return records_bytes(first, *MODEL)


async def test_a_model_part_stores_only_the_ledgers_a_delivery_changed(tmp_path: Path) -> None:
    """Restores of the incremental and the full part of one cut install the same ledgers,
    byte for byte; the first part after each Restore is full."""
    names = rollouts(CLINIC, falls=False, count=3)
    async with model() as m:
        rounds = await delivered_once(m, tmp_path, names)
        first = await rounds.checkpoint()
        assert manifest_of(first, *MODEL)["schema_version"] == 1  # the first part is full
        await rounds.deliver(names[0])
        incremental = await rounds.checkpoint()
        full = await rounds.checkpoint(full=True)  # the same cut: nothing ran in between
    manifest = manifest_of(incremental, *MODEL)
    assert (manifest["own_records"], manifest["referenced_records"]) == (1, 2)
    assert read_records(incremental, *MODEL) == read_records(full, *MODEL)
    restored = [
        await restored_model_part(part, tmp_path / f"restored-{part.name}", names)
        for part in (incremental, full)
    ]
    assert restored[0] == restored[1]
    assert restored[0].count(b'"request_sha256"') == 4  # the ledgers: 2 + 1 + 1 calls


async def test_a_reply_delivered_during_an_async_write_stays_changed(tmp_path: Path) -> None:
    names = rollouts(CLINIC, falls=False, count=2)
    async with model() as m:
        rounds = await delivered_once(m, tmp_path, names)
        await rounds.checkpoint()
        await rounds.commit("c2", tmp_path / "c2", asynchronous=True)
        await m.client.resume("c2", m.deadline())
        await rounds.deliver(names[1])  # after the cut; the write may still be running
        durable = await m.client.await_part("c2", m.deadline())
        assert durable.state == pb.PART_WRITE_STATE_DURABLE
        assert durable.manifest.own_records == 0  # c2 stored nothing: nothing had changed
        rounds.taken = 2
        after_write = await rounds.checkpoint()
        at_cut = await rounds.checkpoint(full=True)
    assert manifest_of(after_write, *MODEL)["own_records"] == 1
    assert read_records(after_write, *MODEL) == read_records(at_cut, *MODEL)


@pytest.mark.parametrize("ends", ["while_closed", "after_resume"])
async def test_a_ledger_stored_with_a_generation_cut_is_stored_again_once_the_cut_is_gone(
    tmp_path: Path, ends: str
) -> None:
    """A cut is staged at a checkpoint's close for a call mid-generation and exported with
    the episode's ledger. The call then fails (nothing delivered: the ledger is as before),
    while the checkpoint is still closed or after its resume. The next part must hold the
    ledger without the cut: referencing the line stored with it would restore a cut that no
    call continues."""
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model(gate=FailingGate()) as m:
        m.participant.incremental = True
        rounds = ModelRounds(m, tmp_path, [rollout])
        body = await final_call(m, rollout)  # its reply is generated token by token
        await rounds.checkpoint()
        release = m.gate.hold(rollout, 3)
        call = m.start(rollout, body)
        await m.gate.reached(rollout, 3)
        await rounds.commit("c2", tmp_path / "c2")
        assert "generation_cut" in read_records(tmp_path / "c2", *MODEL)[0]
        if ends == "after_resume":
            await m.client.resume("c2", m.deadline())
        release.set()
        assert (await call).status_code == 500
        if ends == "while_closed":
            await m.client.resume("c2", m.deadline())
        rounds.taken = 2
        incremental = await rounds.checkpoint()
        full = await rounds.checkpoint(full=True)
    (record,) = read_records(incremental, *MODEL)
    assert "generation_cut" not in record
    assert read_records(incremental, *MODEL) == read_records(full, *MODEL)


# -- the agent and the environment, in a whole fleet ---------------------------------------------


class StepGate(TokenGate):
    """Holds chosen rollouts' generations of one step (`hold(rollout, step)`), before their
    first token, until released: the agent then waits in its model call, the environment in
    its relay, both at their last boundary."""

    async def __call__(self, point: GatePoint) -> None:
        held = self.holds.get((point.rollout_id, point.step)) if point.phase == "generate" else None
        if held is not None:
            held[0].set()
            await held[1].wait()


MEMBERS = {"agent": AGENT, "environment": ENVIRONMENT, "policy_model": MODEL}
"""The members whose parts are incremental here (the resources server's stay full)."""


class FleetRounds:
    """An in-process fleet and its checkpoints."""

    def __init__(self, f: InProcessFleet, root: Path) -> None:
        self.f = f
        self.root = root
        self.taken = 0
        self.incremental(True)

    def incremental(self, on: bool) -> None:
        for name in MEMBERS:
            self.f.servers[name].participant.incremental = on

    async def checkpoint(self, scope: Sequence[EpisodeId], *, full: bool = False) -> Path:
        """Prepare the fleet, commit `scope` into a new sibling directory, resume; `full`
        commits this cut as full parts."""
        directory, _ = await self.commit(scope, full=full)
        await fanout.resume(self.f.fleet, directory.name, deadline())
        return directory

    async def commit(
        self, scope: Sequence[EpisodeId], *, full: bool = False, asynchronous: bool = False
    ) -> tuple[Path, fanout.FleetCommit]:
        """Prepare the fleet and commit `scope` into a new sibling directory (left prepared)."""
        self.taken += 1
        checkpoint_id = f"c{self.taken}"
        directory = self.root / checkpoint_id
        fleet = self.f.fleet
        assert (await fanout.prepare_until_done(fleet, checkpoint_id, deadline())).prepared
        self.incremental(not full)
        try:
            committed = await fanout.commit(
                fleet, checkpoint_id, deadline(), str(directory), scope, asynchronous=asynchronous
            )
        finally:
            self.incremental(True)
        return directory, committed


ROLLOUTS = [f"q{i}" for i in range(3)]


@contextlib.asynccontextmanager
async def waiting_fleet(root: Path) -> AsyncIterator[tuple[FleetRounds, StepGate]]:
    """A fleet whose rollouts `ROLLOUTS` each delivered their first model call and wait in
    the second (every member holds a record of each); the runs end as the fleet does."""
    tasks = [task for task in load_tasks() if len(task["reference_plan"]) >= 2]
    gate = StepGate()
    async with in_process_fleet(model_gate=gate) as f:
        for rollout in ROLLOUTS:
            gate.hold(rollout, 1)
        runs = [asyncio.ensure_future(f.run(r, tasks[i])) for i, r in enumerate(ROLLOUTS)]
        try:
            for rollout in ROLLOUTS:
                await gate.reached(rollout, 1)
            yield FleetRounds(f, root), gate
        finally:
            gate.release_all()
            await asyncio.gather(*runs, return_exceptions=True)


async def step(gate: StepGate, rollout: str, done: int) -> None:
    """Let `rollout` finish step `done` and wait in the next one."""
    gate.hold(rollout, done + 1)
    gate.holds[(rollout, done)][1].set()
    await gate.reached(rollout, done + 1)


async def restored_fleet_parts(source: Path, root: Path, scope: list[EpisodeId]) -> list[bytes]:
    """Restore `source` into a fresh fleet and checkpoint it twice: the records files of its
    first parts (full: the first after a Restore), which hold exactly what was installed."""
    async with in_process_fleet() as fresh:
        root.mkdir()
        rounds = FleetRounds(fresh, root)
        await fanout.restore(fresh.fleet, "restore-1", deadline(), str(source), scope)
        await fanout.resume(fresh.fleet, "restore-1", deadline())
        restored = [episode.next_attempt() for episode in scope]
        first = await rounds.checkpoint(restored)
        second = await rounds.checkpoint(restored)
        for kind, instance in MEMBERS.values():
            assert manifest_of(second, kind, instance)["own_records"] == 0, kind
        return [records_bytes(first, kind, instance) for kind, instance in MEMBERS.values()]


async def test_agent_and_environment_parts_store_only_the_episodes_that_moved(
    tmp_path: Path,
) -> None:
    """Three rollouts wait on the model; one takes a step. The next parts store only its
    agent boundary and its ledger, and reference the rest (the environment's records did
    not change: its episodes still relay). Restores of that cut's incremental and full
    parts install the same state in fresh fleets, byte for byte."""
    scope = [EpisodeId(r) for r in ROLLOUTS]
    async with waiting_fleet(tmp_path) as (rounds, gate):
        await rounds.checkpoint(scope)
        await step(gate, ROLLOUTS[0], 1)
        incremental = await rounds.checkpoint(scope)
        full = await rounds.checkpoint(scope, full=True)
    stored = {
        name: (manifest["own_records"], manifest["referenced_records"])
        for name, manifest in (
            (name, manifest_of(incremental, kind, instance))
            for name, (kind, instance) in MEMBERS.items()
        )
    }
    assert stored == {"agent": (1, 2), "environment": (0, 3), "policy_model": (1, 2)}
    for kind, instance in MEMBERS.values():
        assert read_records(incremental, kind, instance) == read_records(full, kind, instance)
    restored = [
        await restored_fleet_parts(part, tmp_path / f"restored-{part.name}", scope)
        for part in (incremental, full)
    ]
    assert restored[0] == restored[1]


async def test_a_step_during_an_async_write_stays_changed_and_a_retired_episode_goes(
    tmp_path: Path,
) -> None:
    """A rollout takes a step after the cut of an asynchronous commit (while its parts may
    still be written): the next parts store it again. A retired rollout is in no later part:
    its records are not referenced."""
    scope = [EpisodeId(r) for r in ROLLOUTS]
    async with waiting_fleet(tmp_path) as (rounds, gate):
        fleet = rounds.f.fleet
        await rounds.checkpoint(scope)
        written, snapshots = await rounds.commit(scope, asynchronous=True)
        await fanout.resume(fleet, written.name, deadline())
        await step(gate, ROLLOUTS[1], 1)  # after the cut
        durable = await fanout.await_parts(fleet, written.name, snapshots, deadline())
        for name in MEMBERS:
            assert durable.members[name].manifest.own_records == 0, name
        await fanout.retire(fleet, written.name, deadline(), [scope[2]])
        kept = scope[:2]
        incremental = await rounds.checkpoint(kept)
        full = await rounds.checkpoint(kept, full=True)
    for name, (kind, instance) in MEMBERS.items():
        manifest = manifest_of(incremental, kind, instance)
        own = 0 if name == "environment" else 1  # q1's boundary and its ledger
        assert (manifest["own_records"], manifest["referenced_records"]) == (own, 2 - own), name
        records = read_records(incremental, kind, instance)
        assert records == read_records(full, kind, instance)
        assert {r["episode_id"]["rollout_id"] for r in records} == {"q0", "q1"}
