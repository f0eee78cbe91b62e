"""The hiring pipeline's tools: list and read candidates, change their status, send offers.

A mixin of the prompt-injection server, apart from the clinic's tools because each domain's
tools touch only their own part of an environment (candidates and offers here).
"""

from __future__ import annotations

from typing import Any

from rollout_checkpoint.server.resources import tool

from .arguments import (
    CandidateArgs,
    ChangeStatusArgs,
    ListCandidatesArgs,
    SendOfferArgs,
)
from .environment_state import (
    candidate_in,
    candidates_in,
    current_user_in,
    ids_in,
    list_in,
    matches_filter,
    new_id_in,
    now_in,
)
from .sessions import SessionEnvironments


class HiringTools(SessionEnvironments):
    """The hiring pipeline's tools (served as `POST /<tool name>` and over MCP)."""

    @tool("Candidates (id, name, position, status), optionally filtered by status or position.")
    async def list_candidates(self, session_id: str, args: ListCandidatesArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            selected = [
                {
                    "candidate_id": c.get("candidate_id", candidate_id),
                    "name": c.get("name"),
                    "position": c.get("position"),
                    "status": c.get("status"),
                }
                for candidate_id, c in candidates_in(env).items()
                if isinstance(c, dict)
                and matches_filter(c.get("status"), args.status)
                and matches_filter(c.get("position"), args.position)
            ]
            return selected or "No candidates found."

        return self._run(session_id, "list_candidates", run)

    @tool("A candidate's full file: contact, résumé summary, status, interview notes.")
    async def get_candidate(self, session_id: str, args: CandidateArgs) -> dict[str, str]:
        return self._run(
            session_id, "get_candidate", lambda env: candidate_in(env, args.candidate_id)
        )

    @tool("Change a candidate's status (e.g. Phone Screen, Final Round, Rejected).")
    async def change_candidate_status(
        self, session_id: str, args: ChangeStatusArgs
    ) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            candidate = candidate_in(env, args.candidate_id)
            previous = candidate.get("status")
            candidate["status"] = args.status
            return {
                "candidate_id": args.candidate_id.strip(),
                "previous_status": previous,
                "status": args.status,
            }

        return self._run(session_id, "change_candidate_status", run)

    @tool("Send a candidate a job offer (records it and sets the status to `offered`).")
    async def send_offer(self, session_id: str, args: SendOfferArgs) -> dict[str, str]:
        def run(env: dict[str, Any]) -> object:
            candidate_id = args.candidate_id.strip()
            candidate = candidate_in(env, candidate_id)
            offers = list_in(env, "offers")
            offer = {
                "offer_id": new_id_in(env, "OFFER", ids_in(offers, "offer_id")),
                "candidate_id": candidate_id,
                "position": args.position or candidate.get("position", ""),
                "salary": args.salary,
                "start_date": args.start_date,
                "sent_by": current_user_in(env).get("email", ""),
                "date": now_in(env)[:10],
            }
            offers.append(offer)
            candidate["status"] = "offered"
            return {"status": "offer_sent", "offer": offer}

        return self._run(session_id, "send_offer", run)
