"""How one policy model process runs: scripted or proxying, latencies, checkpointing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .generation import Gate
from .policy import DEFAULT_MODEL

if TYPE_CHECKING:
    from .recording import Recording


class InputFileError(ValueError):
    """A file the policy model was given (`--tasks`, `--record`, `--replay`) cannot be used:
    its message is the one line the command prints before it exits 2, naming the file."""


@dataclass(frozen=True)
class PolicyModelConfig:
    """How one policy model process runs."""

    instance: str = "policy_model"
    checkpoint: CheckpointSettings | None = None
    latency: float = 0.05
    """Seconds of simulated generation before every answer."""
    token_latency: float = 0.0
    """Seconds per generated token on top of `latency` (0: the tokens come at once). With it a
    generation is long enough to be cut mid-way (generation_cuts.py)."""
    upstream: str | None = None
    """Base URL of a real OpenAI-compatible server (e.g. `http://host:8000` or `.../v1`): proxy
    mode. None: the scripted model answers."""
    upstream_api_key: str | None = None
    """Sent upstream as `Authorization: Bearer ...` (else the caller's header is forwarded)."""
    upstream_continuation: str = "none"
    """How the upstream continues a generation cut's prefix: `vllm` (vLLM's chat API: the
    prefix as a final assistant message with `continue_final_message: true` and
    `add_generation_prompt: false`), or `none` (the upstream cannot: calls are not cut, and a
    cut call is generated again after a restore). With `vllm` a non-streaming chat call of an
    episode is streamed from the upstream, so the proxy knows the prefix generated so far."""
    upstream_timeout: float = 600.0
    model_name: str = DEFAULT_MODEL
    """The `model` of a reply when the request names none."""
    fall_one_in: int = 4
    """One (task, rollout) pair in this many falls for the injection (0: never)."""
    tasks: tuple[Mapping[str, Any], ...] | None = None
    """The tasks the scripted model knows (default: the shipped prompt-injection tasks;
    `--tasks FILE`: a user's, loaded by `task_file.load_task_file`)."""
    recording: Recording | None = None
    """Record every reply to this recording, or answer every call from it (`--record`,
    `--replay`; recording.py). None: the model answers."""
    replay_latency: float = 0.0
    """Seconds a replayed answer waits before it is sent (`--replay-latency`). A replay that
    answers at once finishes a rollout in milliseconds: a checkpoint or a fault (certify's
    trials) would then meet no rollout in flight, and prove nothing about them."""
    gate: Gate | None = None
    """For tests: awaited at each `GatePoint` of a scripted generation."""
    clock: Clock | None = None
    """For tests: the control plane's clock."""
