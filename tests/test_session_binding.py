"""A session's episode: several sessions per episode, seed retries, no re-binding.

Real counter servers under uvicorn on 127.0.0.1:0, one cookie jar per session, real RPCs.
A restore goes into a second server instance with the same secret, as a replacement process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from rollout_checkpoint.server.episodes import EpisodeId

from .test_resources import Running, prepared, running

WAIT = 10.0


def refusal(reply: httpx.Response) -> str:
    """The code of a 409 refusal, checking its whole shape."""
    assert reply.status_code == 409, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}
    assert isinstance(body["error"]["detail"], str) and body["error"]["detail"]
    code: str = body["error"]["code"]
    return code


async def count(jar: httpx.AsyncClient, key: str) -> Any:
    reply = await jar.post(f"/ng-rollout/{key}/get_counter_value", json={})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


async def restore_into(b: Running, checkpoint: str, scope: list[EpisodeId]) -> list[str]:
    reply = await b.client.restore("restore-1", b.deadline(), checkpoint, scope)
    await b.client.resume("restore-1", b.deadline())
    return list(reply.restored)


# -- several sessions per episode -----------------------------------------------------------


async def test_two_sessions_of_one_episode_are_two_records_and_restore(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    async with running() as a:
        first, second = a.browser(), a.browser()
        for jar, initial in ((first, 3), (second, 8)):
            seeded = await jar.post("/ng-rollout/r/seed_session", json={"initial_count": initial})
            assert seeded.status_code == 200
        await second.post("/ng-rollout/r/increment_counter", json={"count": 1})
        await prepared(a)
        commit = await a.client.commit("c1", a.deadline(), checkpoint)
        assert set(commit.exported) == {"r"} and commit.manifest.record_count == 2
        jars = [first.cookies, second.cookies]
    async with running() as b:
        assert set(await restore_into(b, checkpoint, [EpisodeId("r")])) == {"r-a1"}
        restored = [b.browser(cookies) for cookies in jars]
        assert [await count(jar, "r-a1") for jar in restored] == [3, 9]
        assert {s.episode for s in b.participant.sessions.values()} == {EpisodeId("r", 1)}
