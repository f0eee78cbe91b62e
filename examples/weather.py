"""The weather example: a `stateless` resources server with one pure tool."""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, Field

from rollout_checkpoint.server.resources import CheckpointMode, ResourcesServer, VerifyMode, tool

CONDITIONS = ("sunny", "cloudy", "rain", "snow", "fog", "wind")


class WeatherArgs(BaseModel):
    city: str = Field(min_length=1, max_length=100)


class WeatherServer(ResourcesServer):
    """Not incremental: a `stateless` server exports no session state, so a checkpoint of it
    writes no records for a later one to reference (`checkpoint_incremental` applies to
    `exported` servers only)."""

    checkpoint_mode = CheckpointMode.STATELESS
    checkpoint_verify = VerifyMode.REPLAY

    @tool("The weather in a city (a pure function of the city's name).")
    async def get_weather(self, session_id: str, args: WeatherArgs) -> dict[str, Any]:
        digest = hashlib.sha256(args.city.strip().lower().encode()).digest()
        return {
            "city": args.city,
            "condition": CONDITIONS[digest[0] % len(CONDITIONS)],
            "temperature_c": digest[1] % 45 - 10,
        }

    async def verify(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"reward": 1.0}
