"""Prompt-injection environments scaled up to a target size, deterministically.

Session `i` of a run gets the environment of task `i % 6` (`examples/prompt_injection_tasks.jsonl`)
grown with more records of the same shape (patients or candidates, and inbox messages, with
seeded pseudo-random text) until its JSON reaches the target size. The same `(i, size)`
always gives the same environment, so the benchmark's seeding client and the raw-limit script
(`raw_io.py`, another process) work on identical states.

Standard library only: the raw-limit script imports it.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

TASKS_FILE = Path(__file__).resolve().parent.parent / "examples" / "prompt_injection_tasks.jsonl"
WORDS = [
    "patient",
    "chart",
    "note",
    "follow",
    "up",
    "review",
    "clinic",
    "visit",
    "schedule",
    "lab",
    "result",
    "normal",
    "elevated",
    "medication",
    "dose",
    "refill",
    "daily",
    "twice",
    "weekly",
    "message",
    "reply",
    "urgent",
    "routine",
    "candidate",
    "offer",
    "interview",
    "panel",
    "feedback",
    "strong",
    "hire",
    "position",
    "salary",
    "start",
    "date",
    "team",
    "manager",
    "onboarding",
    "report",
    "summary",
    "allergy",
    "history",
    "vitals",
    "pressure",
    "glucose",
    "cholesterol",
    "referral",
    "specialist",
    "insurance",
    "billing",
    "consent",
    "record",
    "update",
    "please",
    "confirm",
    "thanks",
    "regards",
    "tomorrow",
    "monday",
    "availability",
    "calendar",
    "slot",
    "reschedule",
    "cancel",
    "reason",
    "note",
    "recommended",
    "plan",
    "next",
    "steps",
]


@cache
def task_rows() -> tuple[str, ...]:
    """The example tasks, one JSON text each."""
    return tuple(line for line in TASKS_FILE.read_text().splitlines() if line.strip())


@cache
def task_environments() -> tuple[str, ...]:
    """The six task environments, as JSON text (copied per session by parsing)."""
    return tuple(json.dumps(json.loads(row)["environment"]) for row in task_rows())


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def environment(index: int, target_bytes: int) -> dict[str, Any]:
    """The environment of session `index`, grown to at least `target_bytes` of JSON."""
    bases = task_environments()
    env: dict[str, Any] = json.loads(bases[index % len(bases)])
    rng = random.Random(index * 1_000_003 + target_bytes)
    size = len(json.dumps(env))
    user = env.get("current_user", {}).get("email", "user@example.com")
    healthcare = env.get("domain") == "healthcare"
    messages = env.setdefault("messages", [])
    people = env.setdefault("patients" if healthcare else "candidates", {})
    number = 0
    while size < target_bytes:
        number += 1
        if number % 2:
            message = {
                "message_id": f"MSG-F{number}",
                "from": f"sender{rng.randrange(1000)}@example.com",
                "to": user,
                "subject": _text(rng, 5),
                "body": _text(rng, 40),
                "timestamp": f"2026-03-{1 + number % 28:02d}T09:{number % 60:02d}:00Z",
            }
            messages.append(message)
            size += len(json.dumps(message)) + 2
        else:
            key = f"{'P' if healthcare else 'C'}-F{number}"
            person: dict[str, Any] = {
                "name": _text(rng, 2).title(),
                "status": rng.choice(["active", "Phone Screen", "Final Round", "follow-up"]),
                "notes": [_text(rng, 12) for _ in range(2)],
                "tags": [rng.choice(WORDS) for _ in range(3)],
                "score": rng.randrange(100),
            }
            people[key] = person
            size += len(json.dumps(person)) + len(key) + 6
    return env


def session_state(env: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint state the prompt-injection server exports for this environment."""
    return {"schema_version": 1, "environment": env}
