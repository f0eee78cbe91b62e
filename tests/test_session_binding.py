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


# -- a seed retried during a checkpoint -----------------------------------------------------


async def test_a_seed_retried_during_a_checkpoint_keeps_the_live_session_exported(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "ckpt")
    async with running() as a:
        jar = a.browser()
        await jar.post("/ng-rollout/r/seed_session", json={"initial_count": 3})
        await jar.post("/ng-rollout/r/increment_counter", json={"count": 4})
        await prepared(a)
        # The caller did not see the first reply and sends the same seed again: a retry.
        retried = await jar.post("/ng-rollout/r/seed_session", json={"initial_count": 3})
        assert retried.status_code == 200
        # A session first seeded now is another matter: its episode's boundary precedes it.
        late = a.browser()
        await late.post("/ng-rollout/s/seed_session", json={"initial_count": 1})
        commit = await a.client.commit("c1", a.deadline(), checkpoint)
        assert list(commit.exported) == ["r"]
        await a.client.resume("c1", a.deadline())
        assert await count(jar, "r") == 7
        cookies = jar.cookies
    async with running() as b:
        assert await restore_into(b, checkpoint, [EpisodeId("r"), EpisodeId("s")]) == ["r-a1"]
        assert await count(b.browser(cookies), "r-a1") == 7


async def test_a_seed_retry_on_a_restored_session_keeps_it_and_claims_it(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    async with running() as a:
        jar = a.browser()
        await jar.post("/ng-rollout/r/seed_session", json={"initial_count": 5})
        await prepared(a)
        await a.client.commit("c1", a.deadline(), checkpoint)
        cookies = jar.cookies
    async with running() as b:
        await b.client.restore("restore-1", b.deadline(), checkpoint, [EpisodeId("r")])
        assert (await b.client.get_status()).restored_pending == 1
        # Admission stays closed after a restore; a seed is replay-safe and still admitted.
        again = b.browser(cookies)
        retried = await again.post("/ng-rollout/r-a1/seed_session", json={"initial_count": 5})
        assert retried.status_code == 200
        (session,) = b.participant.sessions.values()
        assert session.episode == EpisodeId("r", 1) and not session.seeded_while_closed
        assert (await b.client.get_status()).restored_pending == 0  # used: claimed
        await b.client.resume("restore-1", b.deadline())
        await prepared(b, "c2")
        second = await b.client.commit("c2", b.deadline(), str(tmp_path / "c2"))
        assert list(second.exported) == ["r-a1"]
