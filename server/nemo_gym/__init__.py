"""Checkpoint NeMo Gym's own resources servers (issue 17): a few lines around `setup_webserver()`.

    server = IPIResourcesServer(config=..., server_client=...)
    app = server.setup_webserver()
    checkpointing = checkpoint_nemo_gym_server(server, app, CheckpointSettings(enabled=True, ...))
    uvicorn.run(app, ...)  # the sidecar starts and stops with the app

`servers` builds NeMo Gym's IPI and counter servers outside `ng_run`, as `rollout-checkpoint
serve nemo-gym:<server>` runs them. nemo-gym itself is imported lazily (`SESSION_ID_KEY`, and
the servers when one is built): importing this package needs no nemo-gym and no ray.
"""

from rollout_checkpoint.server.nemo_gym.hooks import CounterStates, ready_hooks
from rollout_checkpoint.server.nemo_gym.integration import (
    NemoGymCheckpointing,
    checkpoint_nemo_gym_server,
)
from rollout_checkpoint.server.nemo_gym.servers import (
    SERVERS,
    ServerKind,
    add_run_webserver_layers,
    build_server,
)

__all__ = [
    "SERVERS",
    "CounterStates",
    "NemoGymCheckpointing",
    "ServerKind",
    "add_run_webserver_layers",
    "build_server",
    "checkpoint_nemo_gym_server",
    "ready_hooks",
]
