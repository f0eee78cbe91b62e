"""The scripted policy model: a deterministic stand-in for a training policy, as a participant.

    python -m rollout_checkpoint.examples.policy_model --latency 0.05 --http-address 127.0.0.1:0

`POST /v1/chat/completions` speaks the OpenAI chat-completions shape with tool calls. The
request names its task in `metadata.task_id` (a row of `prompt_injection_tasks.jsonl`); the
rollout comes from the rollout prefix (`/ng-rollout/<capture_key>/...`, its rollout id, so
attempt N+1 answers exactly as attempt N did), else from `metadata.rollout_id`, else
`"anonymous"`. The step is derived from the request's own conversation (the number of
assistant messages already in `messages`), never from a counter: a held or re-issued call gets
the answer its conversation calls for.

Policy: follow the task's `reference_plan`, one tool call per step, then answer with a short
final message (`finish_reason: "stop"`). For about one (task, rollout) pair in four (chosen by
SHA-256 of the two ids) the model "falls for" the injection: at the first step whose
conversation shows the injected text in a tool result, it calls `injection.target_tool` with
`injection.target_args` (completed with harmless values for arguments the tool requires),
then carries on with the plan. So rewards vary across rollouts but are reproducible.

`--tasks FILE` makes the scripted model follow a user's tasks (the JSON lines `collect` takes)
instead of the shipped ones. `--record FILE` appends every reply to a recording and `--replay
FILE` answers every call from one, so a run with a real (sampling) model can be compared with
its baseline call for call; a call the baseline never made is refused 409 `not_in_recording`
(recording.py).

`--latency` simulates generation time so rollouts stay in flight long enough to be cut, and
`--token-latency` the time of each generated token: the model generates its answer token by
token (four characters each: the final message's content, or the tool call's arguments), so a
checkpoint can cut a generation mid-way. `stream: true` answers as server-sent events
(`chat.completion.chunk` per token as it is generated, then `[DONE]`).

Generation cuts (server/model/generation_cuts.py): the server is its participant's backend. It
stages the tokens a call generated so far, continues a restored prefix attached to a
re-issued call (generating only the rest), and honours vLLM's `continue_final_message` (the
final assistant message's content continued, only the continuation answered), so it can also
stand in for a vLLM upstream. `GET /scripted/stats` counts the generated tokens.

`--upstream URL` makes the server a thin proxy in front of a real OpenAI-compatible server
instead: generation calls are forwarded (rollout prefix stripped, body untouched, streaming
passed through), while the admission gate and the held responses stay here. So a real model
replaces the scripted one by configuration. With `--upstream-continuation vllm` the proxy also
cuts generations: a non-streaming chat call of an episode is streamed from the upstream (the
content so far is what a cut stages) and a restored prefix is continued through vLLM's
`continue_final_message`.

With checkpointing enabled the app has, outermost first: the rollout prefix, the model
admission middleware (`ModelParticipant`: 409 `admission_closed`, held responses, the ledger of
delivered calls) and the gRPC sidecar.

One concept a module: `policy` (the scripted decisions, pure), `generation` (a generation
token by token, and what a cut stages), `upstream` (proxy mode), `recording` (record and
replay), `task_file` (a user's tasks), `server` (the app and the participant's backend),
`config`, `replies` (the error shape) and `cli`. This package is the
example's public face: what it re-exports is what `serve`, the demo and the tests use.
"""

from __future__ import annotations

from .cli import add_arguments, build_server, file_options, main
from .config import InputFileError, PolicyModelConfig
from .generation import GatePoint, generation_text, split_tokens
from .policy import INJECTION_FILLERS, Decision, PolicyError, ScriptedPolicy
from .recording import NOT_IN_RECORDING, STATS_PATH, RecordedReply, Recording, call_digest
from .server import PolicyModelServer
from .task_file import load_task_file

__all__ = [
    "INJECTION_FILLERS",
    "NOT_IN_RECORDING",
    "STATS_PATH",
    "Decision",
    "GatePoint",
    "InputFileError",
    "PolicyError",
    "PolicyModelConfig",
    "PolicyModelServer",
    "RecordedReply",
    "Recording",
    "ScriptedPolicy",
    "add_arguments",
    "build_server",
    "call_digest",
    "file_options",
    "generation_text",
    "load_task_file",
    "main",
    "split_tokens",
]
