"""Checkpoint NeMo Gym's own resources servers (issue 17): a few lines around `setup_webserver()`.

    server = IPIResourcesServer(config=..., server_client=...)
    app = server.setup_webserver()
    checkpointing = checkpoint_nemo_gym_server(server, app, CheckpointSettings(enabled=True, ...))
    uvicorn.run(app, ...)  # the sidecar starts and stops with the app

nemo-gym itself is imported lazily (only `SESSION_ID_KEY`, from the server's own process, which
already imported it): importing this package needs no nemo-gym and no ray.
"""

from rollout_checkpoint.server.nemo_gym.hooks import CounterStates, ready_hooks
from rollout_checkpoint.server.nemo_gym.integration import (
    NemoGymCheckpointing,
    checkpoint_nemo_gym_server,
)

__all__ = [
    "CounterStates",
    "NemoGymCheckpointing",
    "checkpoint_nemo_gym_server",
    "ready_hooks",
]
