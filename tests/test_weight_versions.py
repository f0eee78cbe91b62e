"""Weight versions: SetWeightVersion on the policy model, the stamp on every model call.

A trainer that updates the policy weights while rollouts run tells the model the version
serving now; every generation call is stamped with the version current at its admission (the
reply header `x-weight-version`, the ledger row's `weight_version`), ListEpisodes tells an
episode's oldest version (live, and restored ledgers right after a Restore), and the example
agent lists the version of each of its model calls in its `/run` result. Servers are real
(uvicorn on 127.0.0.1:0, real HTTP and RPCs); a call the test must catch in flight waits on the
scripted model's test gate, never on a sleep.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.checkpointing import fanout
from rollout_checkpoint.client.participant import ParticipantClient
from rollout_checkpoint.examples.agent import AgentConfig, AgentServer
from rollout_checkpoint.examples.policy_model import PolicyModelConfig, PolicyModelServer
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer
from rollout_checkpoint.server.core.checkpoint_storage import PartStorage
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.part_storage import WriteFence
from rollout_checkpoint.server.model.ledger import restored_ledger
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.participant import RestoredRecord
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .conftest import TOKEN, Harness, refused
from .test_callee_failures import Answer, FailingCallee, serving
from .test_fleet_episodes import deadline as fleet_deadline
from .test_fleet_episodes import in_process_fleet
from .test_policy_model import CLINIC, WAIT, Gate, after, chat, model, rollouts

HEADER = "x-weight-version"
SETTINGS = CheckpointSettings(enabled=True, token=TOKEN)


def injection_server() -> PromptInjectionServer:
    return PromptInjectionServer(
        ResourcesServerConfig(
            instance="prompt_injection", session_secret="wv-test-secret", checkpoint=SETTINGS
        )
    )


def version_of(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    return int(reply.headers[HEADER])


def ledger_versions(ckpt: str, key: str) -> list[int | None]:
    """The `weight_version` of each committed call of episode `key` (None: not recorded)."""
    part = Path(ckpt, "participants", "model", "policy_model")
    manifest = json.loads((part / "manifest.json").read_text())
    for line in (part / manifest["records_file"]).read_text().splitlines():
        record = json.loads(line)
        if EpisodeId.from_json(record["episode_id"]).capture_key == key:
            return [call.get("weight_version") for call in record["calls"]]
    raise AssertionError(f"{key} was not committed")


async def test_the_version_is_set_reported_and_stamped_on_every_reply() -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model() as m:
        assert (await m.client.get_status()).counters["weight_version"] == 0
        first = await m.post(rollout, chat(CLINIC))
        assert version_of(first) == 0

        assert await m.client.set_weight_version(4, m.deadline()) == 0
        assert await m.client.set_weight_version(4, m.deadline()) == 4  # idempotent
        assert (await m.client.get_status()).counters["weight_version"] == 4
        messages = after(chat(CLINIC)["messages"], first)
        second = await m.post(rollout, chat(CLINIC, messages))
        assert version_of(second) == 4
        streamed = await m.post(None, chat(CLINIC, stream=True))  # no episode: stamped too
        assert version_of(streamed) == 4

        # A trainer that went back to an older checkpoint of its own goes back.
        assert await m.client.set_weight_version(2, m.deadline()) == 4
        assert version_of(await m.post(None, chat(CLINIC))) == 2
        assert [
            row["weight_version"] for row in m.participant.ledgers[EpisodeId(rollout)].calls
        ] == [0, 4]

        await refused(
            m.client.set_weight_version(5, m.deadline(-1)), "CHECKPOINT_DEADLINE_EXCEEDED"
        )
        await refused(m.client.set_weight_version(2**63, m.deadline()), "INVALID_REQUEST")
        assert (await m.client.get_status()).counters["weight_version"] == 2


async def test_a_response_held_across_a_checkpoint_keeps_its_admissions_version(
    tmp_path: Path,
) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model() as m:
        await m.client.set_weight_version(1, m.deadline())
        release = m.gate.hold("generate", rollout)
        held = m.start(rollout, chat(CLINIC))
        await m.gate.reached("generate", rollout)
        await m.prepared("c1")
        # Allowed while a checkpoint is open: it changes what new calls are stamped with.
        assert await m.client.set_weight_version(2, m.deadline()) == 1
        release.set()
        await m.until(lambda: m.counts()["held"] == 1)
        await m.client.resume("c1", m.deadline())
        assert version_of(await held) == 1
        (row,) = m.participant.ledgers[EpisodeId(rollout)].calls
        assert row["weight_version"] == 1


async def test_a_participant_without_policy_weights_refuses(harness: Harness) -> None:
    error = await refused(
        harness.client.set_weight_version(3, harness.deadline()), "INVALID_REQUEST"
    )
    assert error.metadata["field"] == "weight_version"
    assert "holds no policy weights" in error.message
    assert "weight_version" not in (await harness.client.get_status()).counters


async def test_a_restored_ledger_lists_its_oldest_version_and_its_calls_keep_theirs(
    tmp_path: Path,
) -> None:
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt, again = str(tmp_path / "c1"), str(tmp_path / "c2")
    async with model() as a:
        await a.client.set_weight_version(3, a.deadline())
        first = await a.post(rollout, chat(CLINIC))
        await a.client.set_weight_version(5, a.deadline())
        messages = after(chat(CLINIC)["messages"], first)
        second = await a.post(rollout, chat(CLINIC, messages))
        assert (version_of(first), version_of(second)) == (3, 5)
        await a.prepared("c1")
        await a.client.commit("c1", a.deadline(), ckpt, [EpisodeId(rollout)])
        assert ledger_versions(ckpt, rollout) == [3, 5]

    restored = EpisodeId(rollout, 1)
    async with model(start_closed=True) as b:  # a fresh process, sealed until its Restore
        assert await b.client.set_weight_version(9, b.deadline()) == 0
        await b.client.restore("restore-1", b.deadline(), ckpt, [EpisodeId(rollout)])
        (episode,) = await b.client.all_episodes()
        assert episode.capture_key == restored.capture_key and episode.restored_pending
        assert episode.HasField("oldest_weight_version") and episode.oldest_weight_version == 3
        assert (await b.client.get_status()).counters["weight_version"] == 9
        await b.client.resume("restore-1", b.deadline())

        # The replacement's next call is sampled now, under version 9; the recorded calls
        # keep the versions they were sampled under, in the episode's listing too.
        release = b.gate.hold("generate", rollout)
        third = b.start(restored.capture_key, chat(CLINIC, after(messages, second)))
        await b.gate.reached("generate", rollout)
        (live,) = await b.client.all_episodes()
        assert live.capture_key == restored.capture_key and not live.restored_pending
        assert live.oldest_weight_version == 3
        release.set()
        assert version_of(await third) == 9
        await b.prepared("c2")
        await b.client.commit("c2", b.deadline(), again, [restored])
        assert ledger_versions(again, restored.capture_key) == [3, 5, 9]
        await b.client.resume("c2", b.deadline())


async def test_a_ledger_recorded_without_versions_restores_with_none_known(
    tmp_path: Path,
) -> None:
    """A part written before versions were recorded: its calls read as unknown, so no
    oldest version is listed, and a call recorded after the restore makes it known."""
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    ckpt = str(tmp_path / "old")
    async with model() as a:
        first = await a.post(rollout, chat(CLINIC))
    old_row = {"request_sha256": "0" * 64, "response": first.json()}
    line = json.dumps({"episode_id": EpisodeId(rollout).to_json(), "calls": [old_row]})
    await asyncio.to_thread(
        PartStorage().write_part,
        ckpt,
        "model",
        "policy_model",
        "old",
        [line.encode()],
        WriteFence(),
    )
    restored = EpisodeId(rollout, 1)
    async with model(start_closed=True) as b:
        await b.client.set_weight_version(6, b.deadline())
        await b.client.restore("restore-1", b.deadline(), ckpt, [EpisodeId(rollout)])
        (episode,) = await b.client.all_episodes()
        assert episode.restored_pending and not episode.HasField("oldest_weight_version")
        await b.client.resume("restore-1", b.deadline())
        messages = after(chat(CLINIC)["messages"], first)
        assert version_of(await b.post(restored.capture_key, chat(CLINIC, messages))) == 6
        ledger = b.participant.ledgers[restored]
        assert [row.get("weight_version") for row in ledger.calls] == [None, 6]
        assert ledger.oldest_weight_version == 6


def test_a_stored_call_whose_version_is_no_version_is_refused() -> None:
    """The record format stays strict: only an integer from 0 to 2^63-1, or nothing."""
    episode = EpisodeId("r1")
    row = {"request_sha256": "0" * 64, "response": {}}
    for bad in (True, -1, 2**63, "3", 1.5, None):
        record = RestoredRecord(episode, {"calls": [{**row, "weight_version": bad}]})
        with pytest.raises(CheckpointError, match="weight_version") as refusal:
            restored_ledger(record)
        assert refusal.value.reason is Reason.INVALID_CHECKPOINT_STATE
    kept = restored_ledger(RestoredRecord(episode, {"calls": [{**row, "weight_version": 7}]}))
    assert kept.oldest_weight_version == 7


async def test_the_agent_lists_the_version_of_each_model_call_across_a_change() -> None:
    """The first model call is admitted under version 0 and held at the gate; the trainer
    moves to version 7 meanwhile; every later call of the rollout is sampled under 7."""
    task = CLINIC
    (rollout,) = rollouts(task, falls=False, count=1)
    gate = Gate()
    release = gate.hold("generate", rollout)
    policy = PolicyModelServer(PolicyModelConfig(checkpoint=SETTINGS, latency=0.0, gate=gate))
    async with serving(policy) as model_url, serving(injection_server()) as resources_url:
        agent = AgentServer(
            AgentConfig(
                model_url=model_url,
                servers={"prompt_injection": resources_url},
                checkpoint=SETTINGS,
            )
        )
        assert policy.runtime is not None
        trainer = ParticipantClient(policy.runtime.address, TOKEN)
        async with serving(agent) as agent_url, httpx.AsyncClient(timeout=WAIT) as http:
            run = asyncio.ensure_future(
                http.post(f"{agent_url}/ng-rollout/{rollout}/run", json={"task": task})
            )
            await gate.reached("generate", rollout)
            assert await trainer.set_weight_version(7, time.time() + WAIT) == 0
            release.set()
            finished = await run
        await trainer.close()
    assert finished.status_code == 200, finished.text
    result: dict[str, Any] = finished.json()
    model_calls = sum(1 for m in result["messages"] if m["role"] == "assistant")
    assert model_calls >= 2
    assert result["weight_versions"] == [0] + [7] * (model_calls - 1)


async def test_an_unstamped_model_reply_counts_as_unknown() -> None:
    """A model that does not stamp its replies (a plain OpenAI-compatible server, no
    checkpoint middleware) contributes null."""
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    completion = {"choices": [{"message": {"role": "assistant", "content": "done"}}]}
    async with (
        serving(FailingCallee({}, Answer(200, completion))) as model_url,
        serving(injection_server()) as resources_url,
    ):
        agent = AgentServer(
            AgentConfig(
                model_url=model_url,
                servers={"prompt_injection": resources_url},
                checkpoint=SETTINGS,
            )
        )
        async with serving(agent) as agent_url, httpx.AsyncClient(timeout=WAIT) as http:
            finished = await http.post(
                f"{agent_url}/ng-rollout/{rollout}/run", json={"task": CLINIC}
            )
    assert finished.status_code == 200, finished.text
    assert finished.json()["weight_versions"] == [None]


async def test_a_rollout_continued_after_a_restore_keeps_its_earlier_turns_versions(
    tmp_path: Path,
) -> None:
    """The fleet is cut while the second model call of a rollout runs (its first delivered
    under version 0), and the part restored into a fresh fleet whose model serves version 7: the model
    lists the restored ledger's oldest version at once, and the continued run reports the
    first turn's version from the agent's boundary beside the later turns' 7."""
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    second_call, generated = asyncio.Event(), asyncio.Event()

    async def gate(point: Any) -> None:
        if point.phase == "generate" and point.step == 1:
            second_call.set()
            await generated.wait()  # released after the commit: not in the checkpoint

    ckpt = str(tmp_path / "c1")
    scope = [EpisodeId(rollout)]
    async with in_process_fleet(model_gate=gate) as first:
        run = asyncio.ensure_future(first.run(rollout, CLINIC))
        await asyncio.wait_for(second_call.wait(), WAIT)
        assert (await fanout.prepare_until_done(first.fleet, "c1", fleet_deadline())).prepared
        await fanout.commit(first.fleet, "c1", fleet_deadline(), ckpt, scope)
        # This fleet goes on to the end (a fleet torn down with runs in flight waits out
        # each server's graceful shutdown); the fresh one below continues from the part.
        generated.set()
        await fanout.resume(first.fleet, "c1", fleet_deadline())
        await run

    async with in_process_fleet() as fresh:
        model_client = fresh.fleet.member("policy_model").client
        assert await model_client.set_weight_version(7, fleet_deadline()) == 0
        await fanout.restore(fresh.fleet, "restore-1", fleet_deadline(), ckpt, scope)
        (pending,) = await model_client.all_episodes()
        assert pending.restored_pending and pending.oldest_weight_version == 0
        await fanout.resume(fresh.fleet, "restore-1", fleet_deadline())
        result = await fresh.run(EpisodeId(rollout, 1).capture_key, CLINIC)
    assert result["continued_from_step"] == 1
    model_calls = sum(1 for m in result["messages"] if m["role"] == "assistant")
    assert result["weight_versions"] == [0] + [7] * (model_calls - 1)
