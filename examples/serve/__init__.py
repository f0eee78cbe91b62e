"""Run one fleet server (an example, one of NeMo Gym's own, or your own as MODULE:ATTRIBUTE)
with its checkpoint sidecar.

    python -m rollout_checkpoint.examples.serve counter --http-address 127.0.0.1:0
    python -m rollout_checkpoint.examples.serve policy_model --latency 0.05
    python -m rollout_checkpoint.examples.serve agent --model-url http://127.0.0.1:8001 \
        --resources prompt_injection=http://127.0.0.1:8002
    python -m rollout_checkpoint.examples.serve environment --agent-url http://127.0.0.1:8003
    python -m rollout_checkpoint.examples.serve nemo-gym:indirect_prompt_injection
    python -m rollout_checkpoint.examples.serve prompt_injection --workers 4
    python -m rollout_checkpoint.examples.serve my_server:MyServer --workers 4

`--workers N` (resources, environment and agent servers) runs N HTTP worker processes behind the
one port and keeps ONE participant: this process binds the port, runs the control plane and the
sidecar, and starts the workers as this same command with the worker variables set
(server/runtime/workers.py); its announcement adds `workers` and `worker_pids`.

Once HTTP and gRPC both listen it prints one JSON line to stdout (`http`, `grpc`, `instance`,
`kind`, `pid`, and `health` when a health-only port is configured) so scripts and tests can
find it; nothing else ever goes to stdout. SIGTERM shuts it down gracefully: health goes
NOT_SERVING at once, HTTP drains, then the sidecar stops. SIGINT does the same. At any moment,
from the imports to the shutdown, either one ends it without a traceback, with 0 (SIGTERM) or
130 (SIGINT): `stop_signals` says how.

`nemo-gym:<server>` serves one of NeMo Gym's own resources servers (`indirect_prompt_injection`,
`example_session_state_mgmt`) from the nemo-gym installed in this environment, built as
`ng_run` builds it but without Ray (`rollout_checkpoint.server.nemo_gym.servers`), checkpointed
with the shipped hooks; its instance name defaults to ng_run's, which also keys its cookies.

`MODULE:ATTRIBUTE` serves the user's own server, a `ResourcesServer` subclass or an app factory,
with the same flags, announcement and signals (`user_app` says what ATTRIBUTE may name and why).

One concept a module: `kinds` (what can be served), `arguments` (the command line and its
refusals), `user_app` (`MODULE:ATTRIBUTE`), `build` (the app for a kind), `workers`
(`--workers N`) and `process` (the process's life: signals, announcement, uvicorn). This package is `serve`'s public face: what it
re-exports is what the CLI, the demo, the benchmarks and the tests use.
"""

from __future__ import annotations

from .arguments import (
    EXIT_ADDRESS_IN_USE,
    EXIT_USAGE,
    checkpoint_settings,
    parse_args,
)
from .build import build
from .kinds import KINDS, NEMO_GYM_KINDS, RESOURCES, default_instance, server_class
from .process import main, run_main
from .uvicorn_server import GRACEFUL_SHUTDOWN_SECONDS
from .workers import WORKER_KINDS, refuse_for_workers, worker_command

__all__ = [
    "EXIT_ADDRESS_IN_USE",
    "EXIT_USAGE",
    "GRACEFUL_SHUTDOWN_SECONDS",
    "KINDS",
    "NEMO_GYM_KINDS",
    "RESOURCES",
    "WORKER_KINDS",
    "build",
    "checkpoint_settings",
    "default_instance",
    "main",
    "parse_args",
    "refuse_for_workers",
    "run_main",
    "server_class",
    "worker_command",
]
