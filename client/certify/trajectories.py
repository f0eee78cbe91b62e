"""What a rollout did, compared with what it did in another run, and whose code it points at.

The invariants and the determinism diagnostics read the same two things from a collector's
output line: the trajectory (the comparison the demo makes, `examples/demo/comparison.py`,
reimplemented here because the controllers never import the examples) and, when two
trajectories differ, the member the first difference points at, the step and the path. One
function does that for both, so a trial's finding and a baseline's finding about the same
difference name the same server, step and path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout_checkpoint.client.certify.findings import ServerFacts
from rollout_checkpoint.client.certify.json_paths import first_difference, under
from rollout_checkpoint.client.certify.observations import RunObservation

TRAJECTORY_PARTS = ("messages", "function_calls", "verify", "reward")
"""The parts of a reply that must equal the baseline's, in the order a rollout makes them
(so the first difference found is the earliest in the episode)."""


def trajectory_of(reply: dict[str, Any]) -> dict[str, Any]:
    """What must equal the baseline: every message (tool calls, arguments, outputs), the
    function calls, the verification and the reward, without the fields that name the
    attempt (a continued or restarted rollout has another attempt and the same trajectory)."""
    return {
        "messages": reply.get("messages"),
        "function_calls": reply.get("function_calls"),
        "verify": dict(reply.get("verify") or {}),
        "reward": reply.get("reward"),
    }


@dataclass(frozen=True)
class Roles:
    """Which fleet member answers for which part of a trajectory."""

    agent: str | None = None
    """The agent member: messages it wrote or relayed (not a tool's output) point at it."""
    policy_model: str | None = None
    """The policy-model member: a replay miss is seen there."""
    resources: tuple[str, ...] = ()
    """The resources members, in the fleet file's order."""

    @classmethod
    def of(cls, servers: Sequence[ServerFacts]) -> Roles:
        return cls(
            agent=next((s.name for s in servers if s.kind == "agent"), None),
            policy_model=next((s.name for s in servers if s.kind == "policy_model"), None),
            resources=tuple(s.name for s in servers if s.kind == "resources"),
        )

    def resources_of(self, task: dict[str, Any]) -> str | None:
        """The resources member a rollout's tools hit: its task's `resources_server`, else the
        fleet's only resources member (None when that cannot be told)."""
        named = task.get("resources_server")
        if isinstance(named, str) and named:
            return named
        return self.resources[0] if len(self.resources) == 1 else None


@dataclass(frozen=True)
class TrajectoryDifference:
    """Where a rollout's trajectory first differs from the expected one."""

    server: str | None
    step: int
    """Tool calls the rollout made before the difference (the step it shows at)."""
    path: str
    """The first differing path, from the trajectory's root (`$.messages[5].content`)."""


def trajectory_difference(
    expected: dict[str, Any], actual: dict[str, Any], task: dict[str, Any], roles: Roles
) -> TrajectoryDifference | None:
    """The first difference of reply `actual` from reply `expected` (None: equal).

    A tool's output, a function call, the verification and the reward come from the
    resources server the task names; any other message (the prompt, the model's turn the
    agent relayed) from the agent. The step counts the tool calls before the difference: a
    restored session that answers its sixth call differently shows at step 5."""
    left, right = trajectory_of(expected), trajectory_of(actual)
    tool_server = roles.resources_of(task)
    calls = _length(left["function_calls"])
    for part in TRAJECTORY_PARTS:
        inside = first_difference(left[part], right[part])
        if inside is None:
            continue
        path = under(f"$.{part}", inside)
        if part == "messages":
            index = _first_index(left[part], right[part])
            before = _as_list(left[part])[:index]
            step = sum(1 for m in before if _role(m) == "tool")
            differing = _at(left[part], index) or _at(right[part], index)
            server = tool_server if _role(differing) == "tool" else roles.agent
            return TrajectoryDifference(server, step, path)
        if part == "function_calls":
            return TrajectoryDifference(tool_server, _first_index(left[part], right[part]), path)
        return TrajectoryDifference(tool_server, calls, path)
    return None


def ok_rows(run: RunObservation) -> dict[str, list[dict[str, Any]]]:
    """Rollout id -> its `ok` output lines, in file order."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for row in run.rows:
        if row.get("status") == "ok":
            rows.setdefault(str(row.get("rollout_id")), []).append(row)
    return rows


def reply_of(row: dict[str, Any]) -> dict[str, Any]:
    reply = row.get("reply")
    return reply if isinstance(reply, dict) else {}


def tool_calls_of(row: dict[str, Any]) -> int:
    """How many tool calls a finished rollout made."""
    return _length(reply_of(row).get("function_calls"))


def _first_index(expected: Any, actual: Any) -> int:
    left, right = _as_list(expected), _as_list(actual)
    for index, (a, b) in enumerate(zip(left, right, strict=False)):
        if first_difference(a, b) is not None:
            return index
    return min(len(left), len(right))


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list | tuple) else 0


def _at(items: Any, index: int) -> Any:
    values = _as_list(items)
    return values[index] if index < len(values) else None


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else None
