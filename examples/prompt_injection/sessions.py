"""Where the prompt-injection tools find their session's environment, and how a tool's failure
is answered.

One place for both, so every tool behaves alike: a call without a seeded session is refused
(400 `no_session`) before it runs, and a tool that raises (its own `ToolError`, or a malformed
environment) still answers 200 with an error string the agent reads, never a 500 that would
end the rollout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import ToolError, no_session_refusal

Handler = Callable[[dict[str, Any]], object]


class SessionEnvironments:
    """The environments of the live sessions (session id -> environment), and the one way a
    tool runs against its session's."""

    environments: dict[str, dict[str, Any]]

    def _environment(self, session_id: str | None) -> dict[str, Any]:
        environment = self.environments.get(session_id) if session_id is not None else None
        if environment is None:
            raise no_session_refusal()
        return environment

    def _run(self, session_id: str, name: str, handler: Handler) -> dict[str, str]:
        environment = self._environment(session_id)
        try:
            result = handler(environment)
        except ToolError as exc:
            return {"output": f"Error: {exc}"}
        except Exception as exc:  # a malformed environment: still an answer, not a 500
            return {"output": f"Error executing {name}: {type(exc).__name__}: {exc}"}
        return {"output": result if isinstance(result, str) else json.dumps(result)}
