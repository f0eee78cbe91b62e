"""A session's episode: several sessions per episode, seed retries, no re-binding.

Real counter servers under uvicorn on 127.0.0.1:0, one cookie jar per session, real RPCs.
A restore goes into a second server instance with the same secret, as a replacement process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.episodes import EpisodeId

from .test_metrics import samples, value
from .test_resources import Running, prepared, running
from .test_resources_mcp import config as mcp_config
from .test_resources_mcp import running as mcp_running

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


# -- one episode per session, for its whole life --------------------------------------------


async def test_a_request_under_another_episode_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    async with running(metrics_path="/metrics") as r:
        jar = r.browser()
        await jar.post("/ng-rollout/r/seed_session", json={"initial_count": 3})
        (session_id,) = r.participant.sessions
        reseed = await jar.post("/ng-rollout/s/seed_session", json={"initial_count": 9})
        assert refusal(reseed) == "episode_mismatch"
        made_up = await jar.post("/ng-rollout/zzz-a9/increment_counter", json={"count": 100})
        assert refusal(made_up) == "episode_mismatch"
        assert refusal(await jar.post("/ng-rollout/s/verify", json={})) == "episode_mismatch"
        assert refusal(await jar.post("/ng-rollout/s/close_session")) == "episode_mismatch"
        # Nothing ran: the session is still r's, its state untouched, r still tracked.
        assert r.participant.sessions[session_id].episode == EpisodeId("r")
        assert r.server.counters == {session_id: 3}
        assert [e.capture_key for e in await r.client.all_episodes()] == ["r"]
        scraped = samples((await jar.get("/metrics")).text)
        refusals = "rollout_checkpoint_refusals_total"
        assert value(scraped, refusals, plane="data", reason="episode_mismatch") == 4
        # Its own prefix, or none (the cookie names the session), still works.
        await jar.post("/ng-rollout/r/increment_counter", json={"count": 1})
        await jar.post("/increment_counter", json={"count": 1})
        assert await count(jar, "r") == 5
        await prepared(r)
        commit = await r.client.commit("c1", r.deadline(), str(tmp_path / "ckpt"))
        assert list(commit.exported) == ["r"]


async def test_a_retired_attempt_answers_stale_attempt_before_episode_mismatch() -> None:
    async with running() as r:
        retired, live = r.browser(), r.browser()
        await retired.post("/ng-rollout/r/seed_session", json={})
        await live.post("/ng-rollout/t/seed_session", json={})
        await r.client.retire("x", r.deadline(), [EpisodeId("r")])
        # The session's attempt is retired: stale, whatever prefix it names.
        other = await retired.post("/ng-rollout/s/increment_counter", json={"count": 1})
        assert refusal(other) == "stale_attempt"
        # The prefix names a retired attempt: stale too, although the session is t's.
        assert refusal(await live.post("/ng-rollout/r/get_counter_value", json={})) == (
            "stale_attempt"
        )
        assert refusal(await live.post("/ng-rollout/u/get_counter_value", json={})) == (
            "episode_mismatch"
        )


class HeldSeedCounter(CounterServer):
    """Its seeds wait for the test when the body says so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed_entered = asyncio.Event()
        self.release = asyncio.Event()

    async def seed_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("hold"):
            self.seed_entered.set()
            await self.release.wait()
        return await super().seed_session(session_id, body)


async def test_racing_first_seeds_of_one_session_bind_it_once() -> None:
    async with running(HeldSeedCounter) as r:
        server = r.server
        assert isinstance(server, HeldSeedCounter)
        jar = r.browser()
        # A seed without a prefix gives the jar a session that no episode tracks yet.
        assert (await jar.post("/seed_session", json={"initial_count": 1})).status_code == 200
        assert not r.participant.sessions
        first = asyncio.ensure_future(
            jar.post("/ng-rollout/r/seed_session", json={"initial_count": 1, "hold": True})
        )
        await asyncio.wait_for(server.seed_entered.wait(), WAIT)
        racing = await jar.post("/ng-rollout/s/seed_session", json={"initial_count": 2})
        assert refusal(racing) == "episode_mismatch"
        server.release.set()
        assert (await asyncio.wait_for(first, WAIT)).status_code == 200
        assert [s.episode for s in r.participant.sessions.values()] == [EpisodeId("r")]
        retry = await jar.post("/ng-rollout/r/seed_session", json={"initial_count": 1})
        assert retry.status_code == 200


async def test_an_mcp_call_under_another_episode_is_refused() -> None:
    async with mcp_running(CounterServer(mcp_config())) as served:
        headers = await served.seed("r1", initial_count=2)
        call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "increment_counter", "arguments": {"count": 5}},
        }
        accept = {"accept": "application/json, text/event-stream"}
        # A fresh client without the cookie: the token alone names the session.
        async with httpx.AsyncClient(base_url=served.base_url, timeout=WAIT) as harness:
            refused = await harness.post(
                "/ng-rollout/s/mcp", json=call, headers={**headers, **accept}
            )
            assert refusal(refused) == "episode_mismatch"
            assert await served.http_count() == 2
            admitted = await harness.post(
                "/ng-rollout/r1/mcp", json=call, headers={**headers, **accept}
            )
            assert admitted.status_code == 200, admitted.text
            assert not admitted.json()["result"].get("isError"), admitted.text
        assert await served.http_count() == 7
