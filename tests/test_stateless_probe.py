"""The stateless probe: a `stateless` server's baseline requests replayed on a fresh process.

Real processes and real HTTP: the baseline of the faulty fleet's `hidden_state` member is a
real `collect` run of the whole fleet (its rows exactly as the agent wrote them); the weather
example's is built from its own real replies. The probe then starts the member again from its
fleet-file command, alone, and replays.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_checkpoint.client.certify.findings import Check
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.certify.stateless_probe import (
    answer_difference,
    baseline_requests,
    probe_stateless,
)
from rollout_checkpoint.client.fleet.launch import start_member
from rollout_checkpoint.client.fleet.spec import FleetSpec

from . import faulty_fleets as fleets
from .faulty_fleets import SCRIPTS_PATH, free_port_fleet, http_url, load, member
from .s3_server import free_ports
from .test_fleet_launch import write_fleet

WAIT = 120.0


@pytest.fixture(autouse=True)
def scripts_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet files' commands run `rollout-checkpoint`: this interpreter's."""
    monkeypatch.setenv("PATH", SCRIPTS_PATH)


async def collected_baseline(fleet: Path, work: Path) -> RunObservation:
    """`collect` of the fleet's tasks, uninterrupted, as certify's baseline is."""
    spec = load(fleet)
    tasks = [json.loads(line) for line in (fleet.parent / "tasks.jsonl").read_text().splitlines()]
    launched = await fleets.start_fleet(spec, work / "logs")
    try:
        command = [*fleets.CLI, *fleets.collect_args(fleet, work)]
        done = await asyncio.to_thread(fleets.run, command, WAIT)
    finally:
        await fleets.stop(launched)
    assert done.returncode == 0, done.stderr
    expected = [f"{task['task_id']}.0" for task in tasks]
    return RunObservation(
        label="baseline",
        expected=expected,
        tasks={f"{task['task_id']}.0": task for task in tasks},
        rows=[json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()],
    )


async def test_the_hidden_state_server_is_caught_replaying_its_own_baseline(
    tmp_path: Path,
) -> None:
    """The faulty `hidden_state` counter (declared stateless, one count for the whole
    process), after a real uninterrupted run of its fleet: the very first request of the
    baseline, replayed twice on a fresh process, cannot be answered the same both times."""
    fleet = free_port_fleet(tmp_path / "fleet")
    baseline = await collected_baseline(fleet, tmp_path / "baseline")
    assert all(row["status"] == "ok" for row in baseline.rows)
    spec = load(fleet)
    counter = member(spec, "hidden_state")
    served = [
        r for r in baseline.expected if baseline.tasks[r]["resources_server"] == "hidden_state"
    ]
    assert len(baseline_requests("hidden_state", baseline)) == 8 * len(served)

    found = await probe_stateless(
        spec, counter, http_url(counter), baseline, deadline=time.time() + WAIT
    )

    (violation,) = found
    assert violation.check == Check.STATELESS_HAS_NO_STATE
    assert (violation.server, violation.session, violation.step, violation.path) == (
        "hidden_state",
        served[0],
        0,
        "$.count",
    )
    assert "increment_counter replayed on a fresh process answered" in violation.detail
    assert violation.trial is None


async def test_a_process_wide_count_is_caught_even_where_replaying_in_order_reproduces_it(
    tmp_path: Path,
) -> None:
    """A baseline of one rollout on a fresh `hidden_state` process answers 1, 3, 6: a fresh
    process replaying those requests once each, in that order, would answer exactly the
    same. Each replayed twice, the second answer gives the hidden count away."""
    spec = load(free_port_fleet(tmp_path / "fleet"))
    counter = member(spec, "hidden_state")
    launched = await start_member(spec, counter, stderr=tmp_path / "baseline.log")
    calls: list[Call] = []
    try:
        async with httpx.AsyncClient(base_url=http_url(counter), timeout=WAIT) as http:
            await http.post("/ng-rollout/one.0/seed_session", json={"environment": {}})
            for count in (1, 2, 3):
                reply = await http.post(
                    "/ng-rollout/one.0/increment_counter", json={"count": count}
                )
                calls.append(("increment_counter", {"count": count}, reply.text))
    finally:
        await fleets.stop([launched])
    assert [json.loads(answer) for _, _, answer in calls] == [{"count": n} for n in (1, 3, 6)]
    baseline = RunObservation(
        "baseline",
        ["one.0"],
        {"one.0": {"resources_server": "hidden_state", "environment": {}}},
        rows=[agent_row("one.0", *calls)],
    )

    found = await probe_stateless(
        spec, counter, http_url(counter), baseline, deadline=time.time() + WAIT
    )

    assert [(v.server, v.session, v.step, v.path) for v in found] == [
        ("hidden_state", "one.0", 0, "$.count")
    ]
    assert "(2 other requests too)" in found[0].detail


def weather_fleet(directory: Path) -> FleetSpec:
    http, grpc = free_ports(2)
    command = ["rollout-checkpoint", "serve", "weather"]
    command += ["--http-address", f"127.0.0.1:{http}", "--grpc-address", f"127.0.0.1:{grpc}"]
    directory.mkdir(parents=True, exist_ok=True)
    fleet = write_fleet(
        directory / "fleet.toml",
        [{"name": "weather", "address": f"127.0.0.1:{grpc}", "command": command}],
    )
    return load(fleet)


CITIES = ("Lisbon", "Oslo", "Nairobi")


async def weather_baseline(spec: FleetSpec, logs: Path) -> RunObservation:
    """One rollout a city, one `get_weather` call each, its tool message the reply's text as
    the example agent records it."""
    launched = await fleets.start_fleet(spec, logs)
    rows = []
    try:
        for city in CITIES:
            # A client per rollout: one session each, as the agent keeps them apart.
            async with httpx.AsyncClient(base_url=http_url(spec.members[0]), timeout=WAIT) as http:
                await http.post(f"/ng-rollout/{city}.0/seed_session", json={})
                reply = await http.post(f"/ng-rollout/{city}.0/get_weather", json={"city": city})
            assert reply.status_code == 200, reply.text
            rows.append(agent_row(f"{city}.0", ("get_weather", {"city": city}, reply.text)))
    finally:
        await fleets.stop(launched)
    return RunObservation(
        label="baseline",
        expected=[row["rollout_id"] for row in rows],
        tasks={row["rollout_id"]: {"resources_server": "weather"} for row in rows},
        rows=rows,
    )


Call = tuple[str, dict[str, Any], str]
"""A tool call as the agent records it: the tool, its arguments, the tool message's content."""


def agent_row(rollout_id: str, *calls: Call) -> dict[str, Any]:
    """An output row with these tool calls, one a step, in the example agent's reply format."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "?"}]
    function_calls = []
    for step, (tool, arguments, answer) in enumerate(calls):
        call_id, arguments_text = f"call_{step}_0", json.dumps(arguments)
        function = {"name": tool, "arguments": arguments_text}
        messages.append(
            {
                "role": "assistant",
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": answer})
        function_calls.append({"type": "function_call", "call_id": call_id, **function})
    messages.append({"role": "assistant", "content": "Done."})
    return {
        "rollout_id": rollout_id,
        "status": "ok",
        "reply": {"messages": messages, "function_calls": function_calls},
    }


async def test_an_honest_stateless_server_passes_and_a_changed_answer_is_found(
    tmp_path: Path,
) -> None:
    """The weather example (a pure function of the city) answers a fresh process as it
    answered the baseline: no finding. The same probe against a baseline whose second answer
    was changed reports that one, at the field that changed: the probe did replay."""
    spec = weather_fleet(tmp_path / "fleet")
    weather = spec.members[0]
    baseline = await weather_baseline(spec, tmp_path / "logs")

    assert (
        await probe_stateless(
            spec, weather, http_url(weather), baseline, deadline=time.time() + WAIT
        )
        == []
    )

    tool_message = baseline.rows[1]["reply"]["messages"][2]
    answer = json.loads(tool_message["content"])
    tool_message["content"] = json.dumps({**answer, "temperature_c": answer["temperature_c"] + 1})
    found = await probe_stateless(
        spec, weather, http_url(weather), baseline, deadline=time.time() + WAIT
    )
    assert [(v.server, v.session, v.step, v.path) for v in found] == [
        ("weather", "Oslo.0", 0, "$.temperature_c")
    ]


async def test_a_passed_deadline_sends_nothing(tmp_path: Path) -> None:
    """Bounded by the deadline: once it passed, nothing is started and no request is sent
    (an answer that differs from the server's is not found)."""
    spec = weather_fleet(tmp_path / "fleet")
    weather = spec.members[0]
    row = agent_row("Oslo.0", ("get_weather", {"city": "Oslo"}, '{"city": "Oslo"}'))
    baseline = RunObservation(
        "baseline", ["Oslo.0"], {"Oslo.0": {"resources_server": "weather"}}, rows=[row]
    )
    found = await probe_stateless(spec, weather, http_url(weather), baseline, deadline=0.0)
    assert found == []


def test_only_the_members_tool_calls_are_taken_each_with_the_message_answering_it() -> None:
    rows = [
        agent_row("a.0", ("get_weather", {"city": "Oslo"}, '{"t": 1}')),
        agent_row(
            "b.0",
            ("increment_counter", {"count": 1}, '{"success": true}'),
            ("increment_counter", {"count": 2}, '{"success": true}'),
        ),
        {"rollout_id": "c.0", "status": "failed", "reply": None},
    ]
    baseline = RunObservation(
        "baseline",
        ["a.0", "b.0", "c.0"],
        {
            "a.0": {"resources_server": "weather"},
            "b.0": {"resources_server": "counter", "environment": {"initial_count": 3}},
            "c.0": {"resources_server": "counter"},
        },
        rows=rows,
    )
    first, second = baseline_requests("counter", baseline)
    assert (first.rollout_id, first.step, first.arguments) == ("b.0", 0, {"count": 1})
    assert (second.rollout_id, second.step, second.arguments) == ("b.0", 1, {"count": 2})
    assert second.name == "increment_counter" and second.answered == '{"success": true}'
    assert second.seed == {"environment": {"initial_count": 3}}


@pytest.mark.parametrize(
    ("expected", "actual", "path"),
    [
        ('{"a": 1, "b": [1, 2]}', '{"b": [1, 2], "a": 1}', None),
        ('{"a": 1}', '{"a": 1.0}', "$.a"),
        ('{"a": {"b c": [1]}}', '{"a": {"b c": [1, 2]}}', '$.a["b c"][1]'),
        ('{"a": 1}', '{"a": 1, "z": 0}', "$.z"),
        ("plain text", "plain text", None),
        ("plain text", "other text", "$"),
    ],
)
def test_answers_compare_as_json_with_the_first_differing_path(
    expected: str, actual: str, path: str | None
) -> None:
    assert answer_difference(expected, actual) == path
