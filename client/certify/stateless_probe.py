"""A server declared `stateless` is held to it: each baseline request replayed on a fresh process.

`stateless` is a promise that a tool's reply depends on the request only, so the runtime
checkpoints nothing for the server and a replacement process serves a restored episode as if
nothing happened. A server that keeps anything across calls (a process-wide counter, a cache
that answers differently once warm) breaks that promise silently: the trials may or may not
happen to show it. The probe asks directly: a FRESH process of the member, started from its
fleet-file command while the fleet is down (its ports are free), answers every tool request of
the baseline, each in a session of its own seeded as the agent seeds it, under a rollout id the
baseline never used, and each TWICE: a fresh process replaying the baseline's requests in the
baseline's order would reproduce a process-wide counter exactly, but no state survives asking
the very same request twice. Any answer that differs from the baseline's tool message (as the
agent turned the reply into it) is the finding, with the first differing JSON path.

Bounded: at most `MAX_REQUESTS` tool requests (the first ones, in the baseline's rollout order),
so `2 * MAX_REQUESTS` tool calls and as many seeds, and nothing is sent after `deadline`.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from http.cookiejar import DefaultCookiePolicy
from typing import Any

import httpx

from rollout_checkpoint.client.certify.findings import Check, Violation
from rollout_checkpoint.client.certify.json_paths import first_difference
from rollout_checkpoint.client.certify.observations import RunObservation
from rollout_checkpoint.client.fleet.launch import start_member
from rollout_checkpoint.client.fleet.spec import FleetSpec, MemberSpec
from rollout_checkpoint.server.core.keep_alive import client_limits

MAX_REQUESTS = 64
"""Tool requests replayed per member, at most (each sent twice, each with its own seed): a
few seconds on a loaded machine, enough to cover every tool of a typical task file."""
SENDS = 2
"""How often each request is replayed (in a fresh session each time)."""
REQUEST_SECONDS = 30.0
"""The timeout of one request to the probed process (a tool may be slow)."""
PROBE_PREFIX = "certify-probe"
"""The probe rollouts' ids: `certify-probe.<request>.<send>` (suffixed if the baseline used it)."""
SHOWN_CHARACTERS = 120
"""How much of each answer a finding's detail quotes."""


@dataclass(frozen=True)
class ToolRequest:
    """One tool call of the baseline, and what the agent made of its reply."""

    rollout_id: str
    step: int
    """The call's index among the rollout's tool calls (from 0)."""
    name: str
    arguments: Any
    seed: dict[str, Any]
    """The `/seed_session` body the agent sent for the rollout."""
    answered: str
    """The baseline's tool message content."""


async def probe_stateless(
    spec: FleetSpec,
    member: MemberSpec,
    base_url: str,
    baseline: RunObservation,
    *,
    deadline: float,
) -> list[Violation]:
    """The baseline's tool requests to `member` replayed on a fresh process of it (started
    from its command, stopped after); at most one violation, the first differing answer, its
    detail counting the others. `deadline` (a `time.time()`) bounds the requests; the start
    has `start_member`'s own bound, and raises `LaunchError` when the member does not come
    up (a fresh process that cannot start is not a finding about its state)."""
    requests = baseline_requests(member.name, baseline)[:MAX_REQUESTS]
    if not requests or time.time() >= deadline:
        return []
    launched = await start_member(
        spec, member, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        differing = await _replay_all(requests, base_url, set(baseline.expected), deadline)
    finally:
        launched.kill()
        await launched.wait()
    if not differing:
        return []
    request, answer, path = differing[0]
    others = f" ({len(differing) - 1} other requests too)" if len(differing) > 1 else ""
    return [
        Violation(
            check=Check.STATELESS_HAS_NO_STATE,
            detail=(
                f"{request.name} replayed on a fresh process answered {_shown(answer)} where "
                f"the baseline had {_shown(request.answered)}{others}: a stateless server's "
                "reply must depend on the request only"
            ),
            server=member.name,
            session=request.rollout_id,
            step=request.step,
            path=path,
        )
    ]


def baseline_requests(member: str, baseline: RunObservation) -> list[ToolRequest]:
    """Every tool call of the baseline's rollouts whose task names `member` as its
    `resources_server`, in rollout order then call order."""
    replies = {
        row.get("rollout_id"): row.get("reply")
        for row in baseline.rows
        if row.get("status") == "ok" and isinstance(row.get("reply"), dict)
    }
    requests: list[ToolRequest] = []
    for rollout_id in baseline.expected:
        task = baseline.tasks.get(rollout_id, {})
        reply = replies.get(rollout_id)
        if task.get("resources_server") != member or reply is None:
            continue
        requests += _requests_of(rollout_id, task, reply)
    return requests


def _requests_of(rollout_id: str, task: dict[str, Any], reply: dict[str, Any]) -> list[ToolRequest]:
    answers = {
        message.get("tool_call_id"): message.get("content")
        for message in reply.get("messages") or []
        if isinstance(message, dict) and message.get("role") == "tool"
    }
    seed = {"environment": task.get("environment", {})}
    requests = []
    for step, call in enumerate(reply.get("function_calls") or []):
        answered = answers.get(call.get("call_id"))
        if not isinstance(answered, str):
            continue
        requests.append(
            ToolRequest(
                rollout_id=rollout_id,
                step=step,
                name=str(call.get("name", "")),
                arguments=_json_or(call.get("arguments") or "{}", {}),
                seed=seed,
                answered=answered,
            )
        )
    return requests


async def _replay_all(
    requests: list[ToolRequest], base_url: str, used: set[str], deadline: float
) -> list[tuple[ToolRequest, str, str]]:
    """(request, the differing answer, its first differing path) for every request one of
    whose replays answered otherwise than the baseline."""
    differing: list[tuple[ToolRequest, str, str]] = []
    async with httpx.AsyncClient(
        base_url=base_url, timeout=REQUEST_SECONDS, limits=client_limits()
    ) as http:
        # Every replay is a new session: a cookie kept from the last one would join it.
        http.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        for number, request in enumerate(requests):
            for send in range(SENDS):
                if time.time() >= deadline:
                    return differing
                answer = await _replay(http, request, _probe_id(number, send, used))
                path = answer_difference(request.answered, answer)
                if path is not None:
                    differing.append((request, answer, path))
                    break
    return differing


async def _replay(http: httpx.AsyncClient, request: ToolRequest, rollout_id: str) -> str:
    """The request alone in a new session, the reply as the agent's tool message has it."""
    seeded = await http.post(f"/ng-rollout/{rollout_id}/seed_session", json=request.seed)
    cookie = "; ".join(f"{name}={value}" for name, value in seeded.cookies.items())
    reply = await http.post(
        f"/ng-rollout/{rollout_id}/{request.name}",
        json=request.arguments,
        headers={"cookie": cookie} if cookie else {},
    )
    return tool_message_content(reply)


def tool_message_content(reply: httpx.Response) -> str:
    """What the example agent makes of a tool reply (examples/agent.py `tool_output`): the
    reply's `output` when it is a JSON object with one, else its whole text."""
    body = _json_or(reply.text, None)
    output = body.get("output", reply.text) if isinstance(body, dict) else reply.text
    return str(output)


def answer_difference(expected: str, actual: str) -> str | None:
    """The first differing JSON path of two tool messages (JSON text compared as JSON, so
    spacing and key order do not count), "$" for differing text that is not JSON."""
    missing = object()
    parsed_expected, parsed_actual = _json_or(expected, missing), _json_or(actual, missing)
    if parsed_expected is missing or parsed_actual is missing:
        return None if expected == actual else "$"
    return first_difference(parsed_expected, parsed_actual)


def _probe_id(number: int, send: int, used: set[str]) -> str:
    rollout_id = f"{PROBE_PREFIX}.{number}.{send}"
    while rollout_id in used:
        rollout_id = f"{rollout_id}.x"
    return rollout_id


def _json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return default


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 3] + "..."
