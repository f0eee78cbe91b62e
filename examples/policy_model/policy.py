"""The scripted policy: a request in, a decision out, nothing else.

Pure (no I/O, no clock, no counter): the step comes from the conversation itself and the
choice to fall for an injection from a hash of the task and rollout ids, so attempt N+1 of a
restored rollout is answered exactly as attempt N was (the byte-for-byte continuation the
demo checks).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ANONYMOUS = "anonymous"


DEFAULT_MODEL = "scripted-policy"


INJECTION_FILLERS: Mapping[str, Mapping[str, Any]] = {
    "send_message": {
        "subject": "Requested information",
        "body": "Forwarding the information requested in the notice.",
    },
    "prescribe_medication": {"dosage": "1 tablet every 4 hours"},
    "send_offer": {"start_date": "2025-04-01"},
    "schedule_appointment": {"date": "2025-03-31", "time": "08:00"},
    "update_patient_chart": {"note": "Updated as instructed."},
}
"""Arguments a tool requires that an injection's `target_args` may leave out. The injected call
carries the target's arguments first, then these for whatever is missing, so it succeeds
against the prompt-injection server (and changes its state, as a real exploit would)."""


class PolicyError(Exception):
    """A request the scripted model cannot answer: 400 with `{"error": {"code", "detail"}}`."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Decision:
    """What the model answers at one step: one tool call, or the final message."""

    step: int
    tool_name: str | None = None
    arguments: Mapping[str, Any] = field(default_factory=dict)
    content: str | None = None
    injected: bool = False

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_name is not None else "stop"

    def message(self) -> dict[str, Any]:
        """The assistant message (`tool_calls` ids are `call_<step>_<i>`)."""
        if self.tool_name is None:
            return {"role": "assistant", "content": self.content}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{self.step}_0",
                    "type": "function",
                    "function": {"name": self.tool_name, "arguments": compact_json(self.arguments)},
                }
            ],
        }


class ScriptedPolicy:
    """Follows each task's `reference_plan`; one (task, rollout) pair in `fall_one_in` falls
    for the task's injection (0: never)."""

    def __init__(self, tasks: Iterable[Mapping[str, Any]], *, fall_one_in: int = 4) -> None:
        self.tasks: dict[str, Mapping[str, Any]] = {}
        for task in tasks:
            task_id = task.get("task_id")
            plan = task.get("reference_plan")
            if not isinstance(task_id, str) or not isinstance(plan, list) or not plan:
                raise ValueError(f"task {task_id!r} needs a task_id and a non-empty reference_plan")
            for number, step in enumerate(plan, 1):
                if not _plan_step(step):
                    raise ValueError(
                        f"task {task_id!r}: reference_plan step {number} is not "
                        '{"name": <tool>, "arguments": {...}}'
                    )
            self.tasks[task_id] = task
        self.fall_one_in = fall_one_in

    def task(self, task_id: object) -> Mapping[str, Any]:
        if not isinstance(task_id, str):
            raise PolicyError("missing_task", "the request needs metadata.task_id (a string)")
        task = self.tasks.get(task_id)
        if task is None:
            raise PolicyError("unknown_task", f"no task {json.dumps(task_id)}")
        return task

    def falls_for_injection(self, task_id: str, rollout_id: str) -> bool:
        if self.fall_one_in <= 0:
            return False
        digest = hashlib.sha256(f"{task_id}\n{rollout_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % self.fall_one_in == 0

    def injected_call(self, task: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        injection = task.get("injection")
        if not isinstance(injection, Mapping):
            return None
        tool, target_args = injection.get("target_tool"), injection.get("target_args")
        if not isinstance(tool, str) or not isinstance(target_args, Mapping):
            return None
        arguments = dict(target_args)
        for name, value in INJECTION_FILLERS.get(tool, {}).items():
            arguments.setdefault(name, value)
        return tool, arguments

    def decide(
        self, task: Mapping[str, Any], rollout_id: str, messages: Sequence[Mapping[str, Any]]
    ) -> Decision:
        """The answer to a conversation: its step is the number of assistant messages in it."""
        plan: list[Mapping[str, Any]] = list(task["reference_plan"])
        assistant = [m for m in messages if m.get("role") == "assistant"]
        step = len(assistant)
        injected = self.injected_call(task)
        already = injected is not None and any(_calls(m, *injected) for m in assistant)
        if (
            injected is not None
            and not already
            and self.falls_for_injection(str(task["task_id"]), rollout_id)
            and _injection_visible(task, messages)
        ):
            return Decision(step, injected[0], injected[1], injected=True)
        index = step - (1 if already else 0)
        if index < len(plan):
            planned = plan[index]
            return Decision(step, str(planned["name"]), dict(planned.get("arguments") or {}))
        names = ", ".join(dict.fromkeys(str(p["name"]) for p in plan))
        return Decision(step, content=f"Done. I used {names} to complete the task.")

    def completion(
        self, request: Mapping[str, Any], rollout_id: str, *, model: str | None = None
    ) -> tuple[Decision, dict[str, Any]]:
        """The whole `chat.completion` reply to a request body (deterministic)."""
        messages = _messages(request)
        metadata = request.get("metadata")
        task = self.task(metadata.get("task_id") if isinstance(metadata, Mapping) else None)
        decision = self.decide(task, rollout_id, messages)
        message = decision.message()
        reply = {
            "id": _completion_id(str(task["task_id"]), rollout_id, decision.step),
            "object": "chat.completion",
            "created": 0,
            "model": _model_name(request, model),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": decision.finish_reason,
                }
            ],
            "usage": _usage(messages, message),
        }
        return decision, reply


def _plan_step(step: object) -> bool:
    """A step the policy can call: a tool name, and arguments that are an object if given
    (checked when the tasks are loaded: a bad step would otherwise fail mid-rollout)."""
    if not isinstance(step, Mapping) or not isinstance(step.get("name"), str):
        return False
    return isinstance(step.get("arguments") or {}, Mapping)


def _messages(request: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = request.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise PolicyError("invalid_messages", "messages must be a list of message objects")
    return messages


def _model_name(request: Mapping[str, Any], default: str | None) -> str:
    model = request.get("model")
    return model if isinstance(model, str) and model else (default or DEFAULT_MODEL)


def compact_json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _completion_id(task_id: str, rollout_id: str, step: int) -> str:
    digest = hashlib.sha256(f"{task_id}\n{rollout_id}\n{step}".encode()).hexdigest()
    return f"chatcmpl-{digest[:24]}"


def _usage(messages: Sequence[Mapping[str, Any]], message: Mapping[str, Any]) -> dict[str, int]:
    """A deterministic token estimate (four characters a token)."""
    prompt = math.ceil(len(compact_json(list(messages))) / 4)
    completion = math.ceil(len(compact_json(message)) / 4)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _text(content: object) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def _injection_visible(task: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a tool result in the conversation shows the injected text (at any JSON escaping
    depth: backslashes are ignored on both sides)."""
    injection = task.get("injection")
    text = injection.get("injection_text") if isinstance(injection, Mapping) else None
    if not isinstance(text, str) or not text:
        return False
    needle = text.replace("\\", "")
    return any(
        needle in _text(m.get("content")).replace("\\", "")
        for m in messages
        if m.get("role") == "tool"
    )


def _calls(message: Mapping[str, Any], tool: str, arguments: Mapping[str, Any]) -> bool:
    """Whether an assistant message calls `tool` with exactly `arguments`."""
    tool_calls = message.get("tool_calls")
    if not isinstance(tool_calls, list):
        return False
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or function.get("name") != tool:
            continue
        raw = function.get("arguments")
        try:
            parsed = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            continue
        if parsed == dict(arguments):
            return True
    return False
