"""The demo's rollouts: one task each, sent to the environment server as `/ng-rollout/<key>/run`.

A rollout remembers whether it was dispatched and what it got back, because the cut is judged
by exactly that: a dispatched rollout without a reply is in flight, and must be continued
(not redone, not lost) after the restore.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.keep_alive import client_limits

from ..prompt_injection import load_tasks


@dataclass
class Rollout:
    rollout_id: str
    task: dict[str, Any]
    reply: dict[str, Any] | None = None
    attempt: int = 0
    dispatched: bool = False
    error: str | None = None


def make_rollouts(count: int) -> list[Rollout]:
    tasks = load_tasks()
    return [Rollout(f"r{i:03d}", tasks[i % len(tasks)]) for i in range(count)]


async def run_one(client: httpx.AsyncClient, env_url: str, rollout: Rollout) -> None:
    key = EpisodeId(rollout.rollout_id, rollout.attempt).capture_key
    rollout.dispatched = True
    try:
        response = await client.post(f"{env_url}/ng-rollout/{key}/run", json={"task": rollout.task})
    except httpx.HTTPError as error:
        rollout.error = f"{type(error).__name__}"
        return
    if response.status_code != 200:
        rollout.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return
    rollout.reply = response.json()


async def run_all(env_url: str, rollouts: list[Rollout], concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=client_limits()) as client:

        async def guarded(rollout: Rollout) -> None:
            async with limit:
                await run_one(client, env_url, rollout)

        await asyncio.gather(*(guarded(r) for r in rollouts))
