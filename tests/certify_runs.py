"""Hand-made runs of a fleet for certify's checks: replies, output lines and observations.

A rollout here is what the example agent makes: a system and a user message, then per step
the model's turn with one tool call and the tool's output, then the model's last turn; the
function calls mirror the tool calls; the verification carries the reward.
"""

from __future__ import annotations

import copy
from typing import Any

from rollout_checkpoint.client.certify.findings import ServerFacts
from rollout_checkpoint.client.certify.observations import RunObservation

SERVERS = [
    ServerFacts("environment", "environment"),
    ServerFacts("policy_model", "policy_model"),
    ServerFacts("agent", "agent"),
    ServerFacts("counter", "resources", "exported"),
    ServerFacts("prompt_injection", "resources", "exported"),
]
ROLLOUTS = ["t1.0", "t2.0", "t3.0"]
"""The rollouts of every hand-made run (tasks t1..t3, one repeat)."""


def reply(outputs: list[str], final: str = "done", reward: float = 1.0) -> dict[str, Any]:
    """The environment's /run reply of a rollout whose tool calls answered `outputs`."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be careful"},
        {"role": "user", "content": "count"},
    ]
    calls = []
    for step, output in enumerate(outputs):
        call_id = f"call-{step}"
        messages.append({"role": "assistant", "tool_calls": [{"id": call_id, "name": "inc"}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        calls.append({"type": "function_call", "call_id": call_id, "name": "inc"})
    messages.append({"role": "assistant", "content": final})
    return {
        "attempt": 0,
        "messages": messages,
        "function_calls": calls,
        "verify": {"reward": reward, "checked": len(outputs)},
        "reward": reward,
    }


def ok_line(rollout_id: str, body: dict[str, Any], attempt: int = 0) -> dict[str, Any]:
    task_id, repeat = rollout_id.rsplit(".", 1)
    return {
        "rollout_id": rollout_id,
        "task_id": task_id,
        "repeat": int(repeat),
        "attempt": attempt,
        "status": "ok",
        "reward": body.get("reward"),
        "reply": body,
    }


def baseline(label: str = "baseline") -> RunObservation:
    """Three rollouts on the counter, each three calls; the counter exported each session."""
    return RunObservation(
        label=label,
        expected=list(ROLLOUTS),
        tasks={r: {"task_id": r[:-2], "resources_server": "counter"} for r in ROLLOUTS},
        rows=[ok_line(r, reply(["1", "2", "3"])) for r in ROLLOUTS],
        exports={"counter": {r: {"count": 3, "log": ["inc", "inc", "inc"]} for r in ROLLOUTS}},
        published=[],
    )


def like(run: RunObservation, label: str = "trial 1") -> RunObservation:
    """A deep copy of `run` under another label (a trial that went exactly like it)."""
    copied = copy.deepcopy(run)
    copied.label = label
    return copied


def row_of(run: RunObservation, rollout_id: str) -> dict[str, Any]:
    return next(r for r in run.rows if r["rollout_id"] == rollout_id)


def set_reply(run: RunObservation, rollout_id: str, body: dict[str, Any]) -> None:
    row = row_of(run, rollout_id)
    row["reply"] = body
    row["reward"] = body.get("reward")
