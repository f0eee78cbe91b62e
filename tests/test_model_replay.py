"""The policy model's record and replay modes, and the scripted model on a user's tasks file.

A baseline is recorded against the scripted model and against the proxy in front of a fake
OpenAI-compatible server that samples (answers differently every time); a replay answers
every recorded call byte for byte (status, content type, body; streamed or not) without
generating anything, refuses a call the baseline never made with a typed 409 it counts, and
keeps working across a checkpoint and a restore (attempt 2 replays attempt 1's answers).
Servers are real (uvicorn on 127.0.0.1:0, real HTTP and RPCs); the command line runs as real
processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_checkpoint.examples.policy_model import (
    NOT_IN_RECORDING,
    STATS_PATH,
    InputFileError,
    Recording,
    call_digest,
    load_task_file,
)
from rollout_checkpoint.server.core.episodes import EpisodeId

from .conftest import TOKEN, serve_app
from .doc_pages import commands
from .doc_steps import differences, steps
from .processes import announcement, kill_group, run
from .processes import start as start_process
from .test_policy_model import CLINIC, WAIT, Model, after, chat, message_of, model, rollouts

DOC_SECTIONS = [("docs/operations.md", "Recording and replaying the model")]
PAGE_SECONDS = 240
CLI = [sys.executable, "-m", "rollout_checkpoint.client.cli.main"]
ENV = dict(os.environ, ROLLOUT_CHECKPOINT_TOKEN=TOKEN, GRPC_VERBOSITY="ERROR")
PATH = "/v1/chat/completions"
USER_TASK = {
    "task_id": "refund-1",
    "user_prompt": "Refund order 42.",
    "reference_plan": [
        {"name": "lookup_order", "arguments": {"order_id": 42}},
        {"name": "refund", "arguments": {"order_id": 42, "reason": "damaged"}},
    ],
}


async def load(path: Path, mode: Literal["record", "replay"]) -> Recording:
    """A recording, read in a thread (its load blocks)."""
    return await asyncio.to_thread(Recording.load, path, mode)


async def episode(
    m: Model, rollout: str, task: dict[str, Any]
) -> list[tuple[dict[str, Any], httpx.Response]]:
    """An episode as an agent plays it, every tool answering "ok": each request and reply."""
    exchanged = []
    messages = chat(task)["messages"]
    for _ in range(20):
        body = chat(task, messages)
        reply = await m.post(rollout, body)
        exchanged.append((body, reply))
        if reply.json()["choices"][0]["finish_reason"] == "stop":
            return exchanged
        messages = after(messages, reply)
    raise AssertionError("the model never stopped")


async def stats(m: Model) -> dict[str, Any]:
    reply = await m.http.get(STATS_PATH)
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def same_reply(replayed: httpx.Response, recorded: httpx.Response) -> None:
    assert replayed.status_code == recorded.status_code
    assert replayed.headers["content-type"] == recorded.headers["content-type"]
    assert replayed.content == recorded.content


# -- the scripted model ------------------------------------------------------------------------


async def test_a_replay_answers_every_recorded_call_byte_for_byte(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.jsonl"
    chosen = [*rollouts(CLINIC, falls=False), *rollouts(CLINIC, falls=True)]
    async with model(recording=await load(baseline, "record")) as recorder:
        recorded = {rollout: await episode(recorder, rollout, CLINIC) for rollout in chosen}
        streamed_body = chat(CLINIC, stream=True)
        streamed = await recorder.post(chosen[0], streamed_body)
        assert streamed.headers["content-type"].startswith("text/event-stream")
        calls = sum(len(exchanged) for exchanged in recorded.values()) + 1
        # Each reply is on disk once its caller has it (appended before it is delivered).
        assert len(baseline.read_bytes().splitlines()) == calls
        counted = await stats(recorder)
        assert (counted["recorded"], counted["replayed"]) == (calls, 0)

    async with model(recording=await load(baseline, "replay")) as replayer:
        for rollout, exchanged in recorded.items():
            for body, reply in exchanged:
                same_reply(await replayer.post(rollout, body), reply)
        same_reply(await replayer.post(chosen[0], streamed_body), streamed)
        # The key is the request, not its serialization: another key order is the same call.
        body, reply = recorded[chosen[1]][1]
        reordered = json.dumps(dict(reversed(list(body.items()))))
        again = await replayer.http.post(
            f"/ng-rollout/{chosen[1]}{PATH}",
            content=reordered,
            headers={"content-type": "application/json"},
        )
        same_reply(again, reply)
        # Nothing was generated: every answer came from the recording.
        generated = (await replayer.http.get("/scripted/stats")).json()
        assert generated["generated_tokens"] == 0
        counted = await stats(replayer)
        assert counted["replayed"] == calls + 1 and counted["not_in_recording"] == 0
        assert counted["replies"] == calls and counted["misses"] == []
        # Replayed replies enter the ledger of delivered calls like generated ones.
        ledger = replayer.participant.ledgers[EpisodeId(chosen[2])].calls
        assert [row["response"] for row in ledger] == [r.json() for _, r in recorded[chosen[2]]]


async def test_a_call_the_baseline_never_made_is_refused_typed_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    baseline = tmp_path / "baseline.jsonl"
    (rollout, other) = rollouts(CLINIC, falls=False)
    async with model(recording=await load(baseline, "record")) as recorder:
        first = await recorder.post(rollout, chat(CLINIC))
    messages = after(chat(CLINIC)["messages"], first, output="something new")
    asked = json.dumps(chat(CLINIC, messages)).encode()
    digest = call_digest(PATH, asked)
    async with model(recording=await load(baseline, "replay")) as replayer:
        with caplog.at_level(logging.WARNING):
            for _ in range(2):  # an agent that re-issues it is refused again
                refused = await replayer.http.post(
                    f"/ng-rollout/{rollout}{PATH}",
                    content=asked,
                    headers={"content-type": "application/json"},
                )
                assert refused.status_code == 409
                error = refused.json()["error"]
                assert error["code"] == NOT_IN_RECORDING
                assert (error["rollout_id"], error["digest"]) == (rollout, digest)
                assert rollout in error["detail"] and digest in error["detail"]
        # The same conversation in another rollout is another call: keyed by rollout.
        elsewhere = await replayer.post(other, chat(CLINIC))
        assert elsewhere.json()["error"]["code"] == NOT_IN_RECORDING
        counted = await stats(replayer)
        assert counted["not_in_recording"] == 3
        assert counted["misses"][:2] == [
            {"rollout_id": rollout, "digest": digest, "path": PATH},
            {
                "rollout_id": other,
                "digest": call_digest(PATH, json.dumps(chat(CLINIC)).encode()),
                "path": PATH,
            },
        ]
        # A caller's rollout id that UTF-8 cannot encode is named too (escaped), not a 500.
        hostile = json.dumps(chat(CLINIC, metadata={"rollout_id": "\ud800"})).encode()
        odd = await replayer.http.post(
            PATH, content=hostile, headers={"content-type": "application/json"}
        )
        assert odd.status_code == 409 and odd.json()["error"]["rollout_id"] == "\ud800"
        assert (await stats(replayer))["misses"][-1]["rollout_id"] == "\ud800"
        # The recorded call is still answered.
        same_reply(await replayer.post(rollout, chat(CLINIC)), first)
    logged = [r.getMessage() for r in caplog.records if NOT_IN_RECORDING in r.getMessage()]
    assert len(logged) == 4 and f"rollout_id={rollout!r} digest={digest}" in logged[0]
    # Logged escaped: a UTF-8 log handler writes every line (a raw lone surrogate would make
    # it drop the line with a "Logging error").
    assert "rollout_id='\\ud800'" in logged[3]
    for message in logged:
        message.encode("utf-8")


@pytest.mark.parametrize("mode", ["replay", "record"])
async def test_a_restored_rollout_replays_attempt_1s_answers(
    tmp_path: Path, mode: Literal["replay", "record"]
) -> None:
    """Attempt 2 of a restored rollout gets the answers its baseline got (replay), or, while
    the baseline is still being recorded, continues the recording as if never interrupted."""
    baseline, checkpoint = tmp_path / "baseline.jsonl", str(tmp_path / "c1")
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    if mode == "replay":
        async with model(recording=await load(baseline, "record")) as recorder:
            uninterrupted = await episode(recorder, rollout, CLINIC)
    else:
        async with model() as reference:
            uninterrupted = await episode(reference, rollout, CLINIC)
    (first_body, first_reply), (second_body, second_reply) = uninterrupted[:2]

    async with model(recording=await load(baseline, mode)) as a:
        same_reply(await a.post(rollout, first_body), first_reply)
        await a.prepared("c1")
        await a.client.commit("c1", a.deadline(), checkpoint, [EpisodeId(rollout)])
        # The second call is never delivered: the process dies at the checkpoint.

    async with model(recording=await load(baseline, mode)) as b:
        restored = await b.client.restore("r1", b.deadline(), checkpoint, [EpisodeId(rollout)])
        assert list(restored.restored) == [f"{rollout}-a1"]
        await b.client.resume("r1", b.deadline())
        same_reply(await b.post(f"{rollout}-a1", second_body), second_reply)
        for body, reply in uninterrupted[2:]:
            same_reply(await b.post(f"{rollout}-a1", body), reply)
        ledger = b.participant.ledgers[EpisodeId(rollout, 1)].calls
        assert [row["response"] for row in ledger] == [r.json() for _, r in uninterrupted]
        assert (await stats(b))["not_in_recording"] == 0
    # Record mode: the recording is the uninterrupted episode's, each call once.
    lines = [json.loads(line) for line in baseline.read_text().splitlines()]
    assert [(line["rollout_id"], line["body"]) for line in lines] == [
        (rollout, reply.text) for _, reply in uninterrupted
    ]


async def test_a_torn_last_line_is_ignored_on_replay_and_cut_before_recording(
    tmp_path: Path,
) -> None:
    baseline = tmp_path / "baseline.jsonl"
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model(recording=await load(baseline, "record")) as recorder:
        first = await recorder.post(rollout, chat(CLINIC))
    intact = baseline.read_bytes()
    torn = intact + b'{"rollout_id": "r9", "dig'  # a crash mid-append
    baseline.write_bytes(torn)

    async with model(recording=await load(baseline, "replay")) as replayer:
        same_reply(await replayer.post(rollout, chat(CLINIC)), first)
    assert baseline.read_bytes() == torn  # a replay never writes its recording

    messages = after(chat(CLINIC)["messages"], first)
    async with model(recording=await load(baseline, "record")) as recorder:
        second = await recorder.post(rollout, chat(CLINIC, messages))
    assert baseline.read_bytes().startswith(intact)
    replayed = await load(baseline, "replay")
    assert len(replayed.replies) == 2

    async with model(recording=replayed) as replayer:
        same_reply(await replayer.post(rollout, chat(CLINIC, messages)), second)

    # Damage before the last line is not a crash artefact: refused, naming the line.
    baseline.write_bytes(b"not json\n" + intact)
    with pytest.raises(InputFileError, match=r"baseline.jsonl:1: the recording holds a line"):
        await load(baseline, "replay")
    baseline.write_bytes(b'{"rollout_id": "r1"}\n')
    with pytest.raises(InputFileError, match=r"baseline.jsonl:1: a recorded reply needs"):
        await load(baseline, "replay")


async def test_a_reply_that_cannot_be_recorded_never_reaches_its_caller() -> None:
    """A disk that is full (/dev/full: every write fails with ENOSPC): the caller gets 503
    `recording_failed` instead of a reply a replay of this run would not know, and a stream
    is cut short rather than finished."""
    (rollout,) = rollouts(CLINIC, falls=False, count=1)
    async with model(recording=Recording(Path("/dev/full"), "record", {})) as recorder:
        refused = await recorder.post(rollout, chat(CLINIC))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "recording_failed"
        with pytest.raises(httpx.RemoteProtocolError):
            await recorder.post(rollout, chat(CLINIC, stream=True))
        counted = await stats(recorder)
        assert (counted["recorded"], counted["replies"]) == (0, 0)


# -- the proxy in front of a model that samples ------------------------------------------------


def sampling_model() -> FastAPI:
    """An OpenAI-compatible server that samples: the same request never gets the same reply."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> JSONResponse:
        await request.body()
        content = f"sampled {random.random()}"
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": 0,
                "model": "sampler",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    return app


@contextlib.asynccontextmanager
async def sampler() -> AsyncIterator[str]:
    runner, serving, port = await serve_app(sampling_model())
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        runner.should_exit = True
        await serving


async def test_the_proxy_replays_a_sampling_model_exactly(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.jsonl"
    chosen = ["q0", "q1", "q2"]
    async with sampler() as upstream:
        async with httpx.AsyncClient(timeout=WAIT) as direct:
            body = chat(CLINIC)
            sampled = {
                (await direct.post(f"{upstream}/chat/completions", json=body)).text
                for _ in range(3)
            }
            assert len(sampled) == 3  # sampling: never the same reply twice
        recorded: dict[str, list[tuple[dict[str, Any], httpx.Response]]] = {}
        async with model(upstream=upstream, recording=await load(baseline, "record")) as proxy:
            for rollout in chosen:
                first = await proxy.post(rollout, chat(CLINIC))
                messages = [*chat(CLINIC)["messages"], message_of(first)]
                messages.append({"role": "user", "content": "and then?"})
                second_body = chat(CLINIC, messages)
                recorded[rollout] = [
                    (chat(CLINIC), first),
                    (second_body, await proxy.post(rollout, second_body)),
                ]
            answers = {r.text for exchanged in recorded.values() for _, r in exchanged}
            assert len(answers) == 2 * len(chosen)
    # Replayed through a proxy whose upstream is gone: nothing goes upstream, all is exact.
    async with model(
        upstream="http://127.0.0.1:9", recording=await load(baseline, "replay")
    ) as proxy:
        for rollout, exchanged in recorded.items():
            for body, reply in exchanged:
                same_reply(await proxy.post(rollout, body), reply)
        counted = await stats(proxy)
        assert counted["replayed"] == 2 * len(chosen) and counted["not_in_recording"] == 0


# -- the command line --------------------------------------------------------------------------


def serve_command(*extra: str) -> list[str]:
    return [*CLI, "serve", "policy_model", "--latency", "0", *extra]


def first_call_of_the_user_task(tasks: Path, *flags: str) -> httpx.Response:
    """`serve policy_model --tasks TASKS FLAGS`'s reply to the user task's first call (the
    server is stopped by SIGTERM after it, and must end as a graceful stop ends)."""
    body = {"messages": [{"role": "user", "content": USER_TASK["user_prompt"]}]}
    body["metadata"] = {"task_id": "refund-1"}
    process = start_process(serve_command("--tasks", str(tasks), *flags), env=ENV)
    try:
        announced = announcement(process, "the policy model")
        with httpx.Client(base_url=f"http://{announced['http']}", timeout=WAIT) as http:
            reply = http.post(f"/ng-rollout/refund-1.0{PATH}", json=body)
            assert reply.status_code == 200, reply.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT) in (0, -signal.SIGTERM)
        return reply
    finally:
        kill_group(process)


def test_serve_follows_a_users_tasks_file_and_records_and_replays_it(tmp_path: Path) -> None:
    tasks, baseline = tmp_path / "my_tasks.jsonl", tmp_path / "baseline.jsonl"
    tasks.write_text(json.dumps(USER_TASK) + "\n")
    replies = []
    for flags in (["--record", str(baseline)], ["--replay", str(baseline)]):
        reply = first_call_of_the_user_task(tasks, *flags)
        (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup_order"
        assert json.loads(call["function"]["arguments"]) == {"order_id": 42}
        replies.append(reply.content)
    assert replies[0] == replies[1]


def test_the_policy_models_own_command_takes_the_file_flags(tmp_path: Path) -> None:
    tasks = tmp_path / "my_tasks.jsonl"
    tasks.write_text(json.dumps(USER_TASK) + "\n")
    own = [sys.executable, "-m", "rollout_checkpoint.examples.policy_model", "--latency", "0"]
    process = start_process([*own, "--tasks", str(tasks), "--no-checkpoint"], env=ENV)
    try:
        announced = announcement(process, "the policy model")
        with httpx.Client(base_url=f"http://{announced['http']}", timeout=WAIT) as http:
            body = {"messages": [], "metadata": {"task_id": "refund-1", "rollout_id": "x"}}
            reply = http.post(PATH, json=body)
            assert message_of(reply)["tool_calls"][0]["function"]["name"] == "lookup_order"
    finally:
        kill_group(process)
    refused = run(*own, "--tasks", str(tmp_path / "missing.jsonl"), env=ENV)
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert "missing.jsonl" in line


def bad_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_serve_refuses_bad_flags_and_files_with_one_line(tmp_path: Path) -> None:
    good = bad_file(tmp_path, "good.jsonl", json.dumps(USER_TASK) + "\n")
    cases = {
        "not a JSON line": (
            ["--tasks", bad_file(tmp_path, "a.jsonl", "{oops\n")],
            "a.jsonl:1: not a JSON line",
        ),
        "no plan": (
            ["--tasks", bad_file(tmp_path, "b.jsonl", '{"task_id": "t"}\n')],
            "b.jsonl: task 't' needs a task_id and a non-empty reference_plan",
        ),
        "a step that is not a call": (
            [
                "--tasks",
                bad_file(tmp_path, "c.jsonl", '{"task_id": "t", "reference_plan": [3]}\n'),
            ],
            "c.jsonl: task 't': reference_plan step 1 is not",
        ),
        "no task_id": (
            [
                "--tasks",
                bad_file(tmp_path, "d.jsonl", '{"reference_plan": [{"name": "x"}]}\n'),
            ],
            "d.jsonl: task 1 has no task_id",
        ),
        "tasks for a proxy": (
            ["--tasks", good, "--upstream", "http://127.0.0.1:9"],
            "--tasks applies to the scripted model, not to --upstream",
        ),
        "no recording to replay": (
            ["--replay", str(tmp_path / "none.jsonl")],
            "cannot open the recording",
        ),
        "a recording that is not one": (
            ["--replay", bad_file(tmp_path, "e.jsonl", '{"digest": 1}\n{}\n')],
            "e.jsonl:1: a recorded reply needs a rollout_id and a digest",
        ),
    }
    for case, (flags, message) in cases.items():
        refused = run(*serve_command(*flags), env=ENV)
        assert refused.returncode == 2, (case, refused.stderr)
        (line,) = refused.stderr.splitlines()
        assert line.startswith("rollout-checkpoint serve: ") and message in line, (case, line)
    never = tmp_path / "never.jsonl"
    both = run(*serve_command("--record", str(never), "--replay", good), env=ENV)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    for flag in ("--record", "--replay", "--tasks"):
        other = run(*CLI, "serve", "counter", flag, good, env=ENV)
        assert other.returncode == 2
        assert f"{flag} applies to policy_model only" in other.stderr
    assert not never.exists()


def test_a_users_tasks_file_loads_as_collect_reads_it(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(USER_TASK) + "\n\n" + json.dumps({**USER_TASK, "task_id": "b"}))
    assert [t["task_id"] for t in load_task_file(tasks)] == ["refund-1", "b"]
    tasks.write_text(json.dumps(USER_TASK) + "\n" + json.dumps(USER_TASK) + "\n")
    with pytest.raises(InputFileError, match="appears twice"):
        load_task_file(tasks)


def test_the_pages_record_and_replay_prints_what_it_shows(tmp_path: Path) -> None:
    """docs/operations.md's recording, as a reader runs it: a baseline recorded on a user's
    tasks, replayed byte for byte, and a new call refused `not_in_recording`."""
    page_steps = steps(commands(*DOC_SECTIONS[0]))
    assert any("--replay" in step.command for step in page_steps)
    wrong, stderr = differences(page_steps, tmp_path, PAGE_SECONDS)
    assert wrong == [], "\n\n".join(wrong) + f"\n\nstderr:\n{stderr[-3000:]}"


def test_a_replay_latency_holds_every_replayed_answer_and_needs_a_replay(tmp_path: Path) -> None:
    """`--replay-latency` makes a replayed rollout take time (certify's faults must meet
    rollouts in flight); it applies to a replay only, and is refused with one line elsewhere."""
    tasks, baseline = tmp_path / "my_tasks.jsonl", tmp_path / "baseline.jsonl"
    tasks.write_text(json.dumps(USER_TASK) + "\n")
    latency = 1.5
    recorded = first_call_of_the_user_task(tasks, "--record", str(baseline))
    replayed = first_call_of_the_user_task(
        tasks, "--replay", str(baseline), "--replay-latency", str(latency)
    )
    assert replayed.content == recorded.content
    assert replayed.elapsed.total_seconds() >= latency
    for flags, message in (
        (["--replay-latency", "0.1"], "--replay-latency applies to --replay only"),
        (
            ["--replay", str(baseline), "--replay-latency", "-1"],
            "--replay-latency is a number of seconds, 0 or more",
        ),
    ):
        refused = run(*serve_command(*flags), env=ENV)
        assert refused.returncode == 2, refused.stderr
        (line,) = refused.stderr.splitlines()
        assert message in line
    other = run(*CLI, "serve", "counter", "--replay-latency", "0.1", env=ENV)
    assert other.returncode == 2
    assert "--replay-latency applies to policy_model only" in other.stderr
