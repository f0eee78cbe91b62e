"""The app and its checkpoint runtime for the chosen server.

The policy model, the agent, the environment and the NeMo Gym integration are imported only
when chosen: `serve counter` does not pay for their imports, and only a `nemo-gym:*` server
needs the nemo-gym extra installed (without it: exit 2 before anything is built).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from rollout_checkpoint.server.core.extras import NEMO_GYM, require
from rollout_checkpoint.server.resources import ResourcesServer, ResourcesServerConfig
from rollout_checkpoint.server.runtime.install import CheckpointRuntime
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .arguments import EXIT_USAGE, fail, split_address
from .kinds import NEMO_GYM_KINDS, RESOURCES, server_class
from .user_app import UserApp, user_code


def build_nemo_gym(
    server: str, instance: str, http_address: str, checkpoint: CheckpointSettings | None
) -> tuple[Any, CheckpointRuntime | None]:
    """One of NeMo Gym's own servers, as `ng_run`'s `run_webserver()` serves it, checkpointed
    with the shipped hooks. Raises `MissingExtra` (exit 2) without nemo-gym or without this
    server in the installed nemo-gym, before anything is built."""
    # Imported here: the integration imports nemo-gym's session key when it installs.
    from rollout_checkpoint.server.nemo_gym import (
        add_run_webserver_layers,
        build_server,
        checkpoint_nemo_gym_server,
    )

    kind = NEMO_GYM_KINDS[server]
    require(replace(NEMO_GYM, modules=(*NEMO_GYM.modules, kind.module)), server)
    host, port = split_address(http_address)
    nemo_gym_server = build_server(kind, instance, host, port)
    app = nemo_gym_server.setup_webserver()
    add_run_webserver_layers(nemo_gym_server, app)
    installed = checkpoint_nemo_gym_server(nemo_gym_server, app, checkpoint)
    return app, installed.runtime if installed is not None else None


def build_resources(
    cls: type[ResourcesServer],
    args: argparse.Namespace,
    instance: str,
    checkpoint: CheckpointSettings | None,
) -> tuple[Any, CheckpointRuntime | None]:
    """A resources server, an example's or the user's own, configured from the flags."""
    config = ResourcesServerConfig(
        instance=instance,
        checkpoint=checkpoint,
        session_secret=args.session_secret
        or os.environ.get("ROLLOUT_CHECKPOINT_SESSION_SECRET")
        or None,
        expose_tools_over_mcp=True if args.mcp else None,
    )
    resources = cls(config)
    return resources.build_app(), resources.runtime


def build_user_app(
    user_app: UserApp,
    args: argparse.Namespace,
    instance: str,
    checkpoint: CheckpointSettings | None,
) -> tuple[Any, CheckpointRuntime | None]:
    """`serve MODULE:ATTRIBUTE`'s app: what the user's code raises is one line and exit 2."""
    target = user_app.target
    if isinstance(target, type):
        with user_code(user_app.reference):
            return build_resources(target, args, instance, checkpoint)
    return user_app.from_factory(target, checkpoint)


def build(
    args: argparse.Namespace,
    instance: str,
    checkpoint: CheckpointSettings | None,
    user_app: UserApp | None = None,
) -> tuple[Any, CheckpointRuntime | None]:
    """The app and its checkpoint runtime for the chosen server (`user_app`: what
    MODULE:ATTRIBUTE named, loaded)."""
    if user_app is not None:
        return build_user_app(user_app, args, instance, checkpoint)
    if args.server in NEMO_GYM_KINDS:
        return build_nemo_gym(args.server, instance, args.http_address, checkpoint)
    if args.server in RESOURCES:
        return build_resources(server_class(args.server), args, instance, checkpoint)
    if args.server == "policy_model":
        from ..policy_model import InputFileError, PolicyModelConfig, PolicyModelServer
        from ..policy_model import file_options as policy_model_files

        try:
            files = policy_model_files(args)
        except InputFileError as error:
            fail(EXIT_USAGE, str(error))
        model = PolicyModelServer(
            PolicyModelConfig(
                instance=instance,
                checkpoint=checkpoint,
                latency=args.latency,
                token_latency=args.token_latency,
                upstream=args.upstream,
                upstream_continuation=args.upstream_continuation,
                **files,
            )
        )
        return model.build_app(), model.runtime
    if args.server == "agent":
        from ..agent import AgentConfig, AgentServer

        if args.model_url is None:
            fail(EXIT_USAGE, "agent: --model-url is required")
        servers = dict(item.split("=", 1) for item in args.resources)
        agent = AgentServer(
            AgentConfig(
                instance=instance, model_url=args.model_url, servers=servers, checkpoint=checkpoint
            )
        )
        return agent.build_app(), agent.runtime
    from ..environment import EnvironmentConfig, EnvironmentServer

    if args.agent_url is None:
        fail(EXIT_USAGE, "environment: --agent-url is required")
    environment = EnvironmentServer(
        EnvironmentConfig(
            instance=instance,
            agent_url=args.agent_url,
            resources_server=args.resources_server,
            checkpoint=checkpoint,
        )
    )
    return environment.build_app(), environment.runtime
