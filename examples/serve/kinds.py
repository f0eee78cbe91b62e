"""What `serve` can run: the examples' servers and NeMo Gym's own, by the name `serve` takes.

One table, read by the command line (its choices), the announcement line (`kind`) and
`--workers` (which kinds may run several, placed how): a server listed in one of them and
missing from another would be accepted and then refused, or announced as the wrong kind. The
CLI's own list of servable kinds (client/cli/main.py) is kept equal to it by a test.
"""

from __future__ import annotations

import importlib
import re

from rollout_checkpoint.server.nemo_gym.servers import SERVERS as NEMO_GYM_SERVERS
from rollout_checkpoint.server.resources import ResourcesServer

RESOURCES = {
    "weather": "rollout_checkpoint.examples.weather:WeatherServer",
    "counter": "rollout_checkpoint.examples.counter:CounterServer",
    "prompt_injection": "rollout_checkpoint.examples.prompt_injection:PromptInjectionServer",
}


NEMO_GYM_PREFIX = "nemo-gym:"


NEMO_GYM_KINDS = {f"{NEMO_GYM_PREFIX}{name}": kind for name, kind in NEMO_GYM_SERVERS.items()}
"""NeMo Gym's own servers, by the name `serve` takes (`nemo-gym:<NeMo Gym's package name>`)."""


KINDS = (
    {name: "resources" for name in RESOURCES}
    | {
        "policy_model": "model",
        "agent": "agent",
        "environment": "environment",
    }
    | {name: "resources" for name in NEMO_GYM_KINDS}
)


USER_APP = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
"""`serve MODULE:ATTRIBUTE`, the user's own server (user_app.py): both dotted Python names, so
`nemo-gym:<server>` never matches (a hyphen is in no module name)."""


def is_user_app(server: str) -> bool:
    return USER_APP.fullmatch(server) is not None


NOT_FOR_NEMO_GYM = {
    "mcp": "--mcp",
    "session_secret": "--session-secret",
}
"""Resources flags a NeMo Gym server cannot honour (it has no MCP endpoint of ours, and its
cookie secret is its own, derived from its class and instance name): refused rather than
silently ignored, since a secret the operator set and we dropped would be a surprise. A user's
app factory (`serve MODULE:ATTRIBUTE`) cannot honour them either: it configures its own app."""


def server_class(name: str) -> type[ResourcesServer]:
    module, _, attribute = RESOURCES[name].partition(":")
    cls: type[ResourcesServer] = getattr(importlib.import_module(module), attribute)
    return cls


def default_instance(server: str) -> str:
    """The instance name when `--instance` is not given: the server's name, or for a NeMo
    Gym server the one `ng_run` gives it (its cookie's name and secret derive from it)."""
    if server in NEMO_GYM_KINDS:
        return NEMO_GYM_KINDS[server].instance
    return server
