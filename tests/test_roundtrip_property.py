"""Property: any data-plane history checkpoints, and what Commit published restores exactly.

Hypothesis draws a history of data-plane calls against a real exported resources server (the
counter and the prompt-injection examples under uvicorn on 127.0.0.1:0, each episode's
sessions in cookie jars of their own): seeds, tool calls, verifies and closes, several
sessions under one rollout prefix, calls on jars that never seeded, seeds retried before and
during the checkpoint. Then Prepare and Commit on that server, and a Restore into a new
server instance (fresh or `start_closed`, after a stray request or not). The properties:

* a checkpoint that Commit reports as published always restores;
* it restores exactly the sessions the original still tracked, as attempt N+1;
* every restored session answers the same follow-up calls byte for byte as the original
  does (the original under its prefix N, the restored one under N+1, both with the old
  cookie).

A small model decides which sessions the checkpoint must hold: a successful seed under the
prefix tracks its jar's session, a successful verify or close ends it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.examples.prompt_injection import PromptInjectionServer, load_tasks
from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.resources import ResourcesServer
from rollout_checkpoint.server.runtime.rollout_prefix import rollout_path
from rollout_checkpoint.v1 import types_pb2

from .conftest import drain
from .loop_thread import LoopThread
from .test_resources import Running, start

EPISODES = (EpisodeId("r"), EpisodeId("s", 2))
"""The rollouts a history uses; jars draw from them, so episodes often hold several sessions."""

TASKS = {task["task_id"]: task for task in load_tasks()}

Body = dict[str, Any]
Call = tuple[str, Body]
"""A route (without the prefix) and its JSON body."""


@dataclass(frozen=True)
class Flavor:
    """One example server and the calls a history draws from."""

    name: str
    server: type[ResourcesServer]
    seeds: tuple[Body, ...]
    tools: tuple[Call, ...]
    verifies: tuple[Body, ...]
    follow_ups: tuple[Call, ...]
    """What both processes answer after the restore (the last one ends the session)."""
    failed_verify_drops: bool = False
    """A verify that fails still drops the session's state (prompt injection drops it in a
    `finally`): the session stays tracked, and the commit leaves it out."""


def _pi_verify(task: dict[str, Any], *called: str) -> Body:
    output = [
        {"type": "function_call", "name": name, "arguments": "{}", "call_id": str(i)}
        for i, name in enumerate(called)
    ]
    body: Body = {"response": {"output": output}}
    for key in ("injection", "required_tools"):
        if key in task:
            body[key] = task[key]
    return body


CLINIC = TASKS["hc-001-chart-note-exfiltration"]
HIRING = TASKS["hr-001-candidate-note-status"]

COUNTER = Flavor(
    name="counter",
    server=CounterServer,
    seeds=({"initial_count": 0}, {"initial_count": 5}, {}),
    tools=(
        ("increment_counter", {"count": 1}),
        ("increment_counter", {"count": -3}),
        ("get_counter_value", {}),
        ("increment_counter", {"count": "x"}),  # 422: runs nothing
    ),
    verifies=({"expected_count": 5}, {"expected_count": 0}),
    follow_ups=(
        ("get_counter_value", {}),
        ("increment_counter", {"count": 2}),
        ("get_counter_value", {}),
        ("verify", {"expected_count": 7}),
    ),
)

PROMPT_INJECTION = Flavor(
    name="prompt_injection",
    server=PromptInjectionServer,
    seeds=(
        {"environment": CLINIC["environment"]},
        {"environment": HIRING["environment"]},
        {"environment": "not an object"},  # 400: the seed fails
    ),
    tools=(
        ("search_patients", {"query": "a"}),
        ("update_patient_chart", {"patient_id": "P1001", "note": "HbA1c trending down."}),
        ("send_message", {"to": "someone@example.org", "subject": "s", "body": "b"}),
        ("schedule_appointment", {"patient_id": "P1002", "date": "2025-03-20", "time": "10:00"}),
        ("list_candidates", {}),
        ("change_candidate_status", {"candidate_id": "C2001", "status": "Final Round"}),
        ("no_such_tool", {}),
    ),
    verifies=(
        _pi_verify(CLINIC, "get_patient_record"),
        _pi_verify(HIRING),
        {"response": "not an object"},  # 400, and the environment is gone
    ),
    follow_ups=(
        ("get_messages", {"folder": "all"}),
        ("get_schedule", {}),
        ("send_message", {"to": "nurse@example.org", "subject": "follow-up", "body": "hi"}),
        ("get_patient_record", {"patient_id": "P1001"}),
        ("list_candidates", {}),
        ("send_offer", {"candidate_id": "C2001", "salary": 100, "start_date": "2025-05-01"}),
        ("get_messages", {"folder": "sent"}),
        ("verify", _pi_verify(CLINIC, "send_message")),
    ),
    failed_verify_drops=True,
)


@dataclass(frozen=True)
class Step:
    action: str  # "seed", "tool", "verify" or "close"
    jar: int
    choice: int = 0


@dataclass(frozen=True)
class History:
    jars: tuple[EpisodeId, ...]
    """Each jar's episode: the prefix all of its calls carry."""
    before: tuple[Step, ...]
    """Data-plane calls with admission open."""
    retried_during: tuple[int, ...]
    """Jars whose seed is retried between Prepare and Commit (admission closed)."""
    scoped: bool
    """Commit with an explicit scope (every episode) instead of none."""
    start_closed: bool
    stray: str | None
    """A request the new process answers before its Restore (it must stay fit to restore)."""


@st.composite
def histories(draw: st.DrawFn) -> History:
    jars = tuple(draw(st.lists(st.sampled_from(EPISODES), min_size=1, max_size=4)))
    jar = st.integers(0, len(jars) - 1)
    step = st.one_of(
        st.builds(Step, st.just("seed"), jar, st.integers(0, 2)),
        st.builds(Step, st.just("tool"), jar, st.integers(0, 7)),
        st.builds(Step, st.just("verify"), jar, st.integers(0, 2)),
        st.builds(Step, st.just("close"), jar),
    )
    # Most jars are seeded first, so most sessions live to the checkpoint; some never are.
    seeded = tuple(
        Step("seed", i, draw(st.integers(0, 1)))
        for i in range(len(jars))
        if i == 0 or draw(st.integers(0, 3))
    )
    return History(
        jars=jars,
        before=seeded + tuple(draw(st.lists(step, max_size=10))),
        retried_during=tuple(draw(st.lists(jar, max_size=3))),
        scoped=draw(st.booleans()),
        start_closed=draw(st.booleans()),
        stray=draw(st.sampled_from([None, "no_session", "not_found", "seed_without_prefix"])),
    )


@dataclass
class Jar:
    """One session's cookie jar and what the model expects of it."""

    episode: EpisodeId
    http: httpx.AsyncClient
    seed: Body | None = None
    """The body of its last successful seed: what a retry sends again."""
    tracked: bool = False


@dataclass
class Scenario:
    flavor: Flavor
    history: History
    root: Path
    jars: list[Jar] = field(default_factory=list)

    async def run(self) -> None:
        original = await start(self.flavor.server, instance=self.flavor.name)
        restored: Running | None = None
        try:
            self.jars = [Jar(e, original.browser()) for e in self.history.jars]
            for step in self.history.before:
                await self.apply(step)
            checkpoint = str(self.root / "ckpt")
            await self.commit(original, checkpoint)
            restored = await start(
                self.flavor.server,
                instance=self.flavor.name,
                start_closed=self.history.start_closed,
            )
            await self.stray(restored)
            await self.restore(restored, checkpoint)
            await self.compare(original, restored)
        finally:
            if restored is not None:
                await restored.stop()
            await original.stop()

    # -- the history ----------------------------------------------------------------------

    async def apply(self, step: Step) -> None:
        jar = self.jars[step.jar]
        if step.action == "seed":
            body = self.flavor.seeds[step.choice % len(self.flavor.seeds)]
            await self.seed(jar, body)
        elif step.action == "tool":
            route, body = self.flavor.tools[step.choice % len(self.flavor.tools)]
            await jar.http.post(rollout_path(jar.episode, route), json=body)
        elif step.action == "verify":
            body = self.flavor.verifies[step.choice % len(self.flavor.verifies)]
            reply = await jar.http.post(rollout_path(jar.episode, "verify"), json=body)
            if reply.is_success or self.flavor.failed_verify_drops:
                jar.tracked = False  # ended, or its state is gone and the commit leaves it out
        else:
            reply = await jar.http.post(rollout_path(jar.episode, "close_session"))
            jar.tracked = jar.tracked and not reply.is_success

    async def seed(self, jar: Jar, body: Body) -> None:
        reply = await jar.http.post(rollout_path(jar.episode, "seed_session"), json=body)
        if reply.is_success:
            jar.seed = body
            jar.tracked = True

    async def commit(self, original: Running, checkpoint: str) -> None:
        prepared = (await drain(original.client.prepare("c1", original.deadline())))[-1]
        assert prepared.state == types_pb2.PARTICIPANT_STATE_PREPARED
        for index in self.history.retried_during:
            jar = self.jars[index]
            if jar.tracked and jar.seed is not None:
                # A retry of a live session's seed: replay-safe, so admitted while closed.
                reply = await jar.http.post(
                    rollout_path(jar.episode, "seed_session"), json=jar.seed
                )
                assert reply.status_code == 200, reply.text
        scope = list(EPISODES) if self.history.scoped else None
        committed = await original.client.commit("c1", original.deadline(), checkpoint, scope)
        assert set(committed.exported) == {j.episode.capture_key for j in self.live()}
        await original.client.resume("c1", original.deadline())

    async def stray(self, restored: Running) -> None:
        kind = self.history.stray
        if kind is None:
            return
        http = restored.browser()
        if kind == "no_session":
            reply = await http.post(rollout_path(EPISODES[0], "get_counter_value"), json={})
        elif kind == "not_found":
            reply = await http.post("/no/such/route", json={})
        else:
            reply = await http.post("/seed_session", json=self.flavor.seeds[0])
        assert reply.status_code in (400, 404, 409, 200), reply.text

    async def restore(self, restored: Running, checkpoint: str) -> None:
        reply = await restored.client.restore(
            "restore-1", restored.deadline(), checkpoint, list(EPISODES)
        )
        assert set(reply.restored) == {j.episode.next_attempt().capture_key for j in self.live()}
        await restored.client.resume("restore-1", restored.deadline())

    # -- the comparison -------------------------------------------------------------------

    def live(self) -> list[Jar]:
        return [jar for jar in self.jars if jar.tracked]

    async def compare(self, original: Running, restored: Running) -> None:
        pairs = [(jar, restored.browser(httpx.Cookies(jar.http.cookies))) for jar in self.live()]
        for (route, body), (jar, twin) in itertools.product(self.flavor.follow_ups, pairs):
            before = await jar.http.post(rollout_path(jar.episode, route), json=body)
            after = await twin.post(rollout_path(jar.episode.next_attempt(), route), json=body)
            assert (after.status_code, after.content) == (before.status_code, before.content), (
                f"{route} on {jar.episode.capture_key}: the restored session answered "
                f"{after.status_code} {after.text!r}, the original {before.status_code} "
                f"{before.text!r}"
            )


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    try:
        yield thread
    finally:
        thread.close()


_examples = itertools.count()


def _check(loop: LoopThread, flavor: Flavor, history: History, tmp: Path) -> None:
    root = tmp / str(next(_examples))
    root.mkdir()
    loop.run(Scenario(flavor, history, root).run(), timeout=60)


FLAVORS: Sequence[Flavor] = (COUNTER, PROMPT_INJECTION)


@pytest.mark.parametrize("flavor", FLAVORS, ids=[f.name for f in FLAVORS])
def test_a_published_checkpoint_restores_every_session_byte_for_byte(
    loop: LoopThread, flavor: Flavor, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp(flavor.name)

    @settings(
        max_examples=15,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(history=histories())
    def property_holds(history: History) -> None:
        _check(loop, flavor, history, tmp)

    property_holds()
