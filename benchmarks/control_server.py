"""The counter example with an HTTP/JSON control route next to its gRPC sidecar (benchmark 4).

    python -m benchmarks.control_server --token T

`GET /ng-control/v1/checkpoint/status` and `POST /ng-control/v1/checkpoint/prepare`
(`{"checkpoint_id", "deadline"}`) do what the sidecar's `GetStatus` and `Prepare` do, in the
same process and on the same control plane: check the bearer token (constant time), open the
same observed operation (metrics, span, log line), call the control plane, and answer JSON
instead of protobuf (a prepare answers its final update, as an HTTP control plane does). So
the comparison with gRPC is the transport and encoding, nothing else. Prints the usual
announcement line (`http`, `grpc`, `instance`, `kind`, `pid`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, ClassVar

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse

from rollout_checkpoint.examples.counter import CounterServer
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.rpc.auth import token_matches
from rollout_checkpoint.server.resources import ResourcesServerConfig
from rollout_checkpoint.server.runtime.control_plane import ControlPlane, PrepareUpdate
from rollout_checkpoint.server.runtime.participant import ReadinessReport
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

CONTROL = "/ng-control/v1/checkpoint"


class ControlRouteCounter(CounterServer):
    # The control routes are no data routes: never counted in flight, never refused.
    passthrough_paths: ClassVar[frozenset[str]] = frozenset(
        {f"{CONTROL}/status", f"{CONTROL}/prepare"}
    )


def _report(report: ReadinessReport) -> dict[str, Any]:
    return {
        "ready": report.ready,
        "blockers": [
            {"capture_key": b.capture_key, "reason": b.reason.value, "detail": b.detail}
            for b in report.blockers
        ],
        "blocker_count": report.blocker_count,
        "counts": dict(report.counts),
    }


def _update(update: PrepareUpdate) -> dict[str, Any]:
    return {
        "state": update.state.value,
        "checkpoint_id": update.checkpoint_id,
        "readiness": _report(update.report),
        "sequence": update.sequence,
        "elapsed": update.elapsed,
        "update_kind": update.kind.value,
        "final": update.final,
        "replayed": update.replayed,
        "admission_open": update.admission_open,
        "lease_expires_at": update.lease_expires_at,
    }


def _refused(error: CheckpointError) -> JSONResponse:
    return JSONResponse(
        {"error": {"reason": error.reason.value, "message": error.message}}, status_code=409
    )


def add_control_routes(app: Any, control: ControlPlane, token: str, boot_id: str) -> None:
    observer = control.observer

    def authorized(request: Request) -> bool:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        matches = token_matches(presented.strip(), token)
        return scheme.lower() == "bearer" and matches

    async def status(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": {"reason": "TOKEN_INVALID"}}, status_code=401)
        with observer.operation("GetStatus", request.headers.items()):
            snapshot = await control.status()
            return JSONResponse(
                {
                    "state": snapshot.state.value,
                    "checkpoint_id": snapshot.checkpoint_id,
                    "admission_open": snapshot.admission_open,
                    "readiness": _report(snapshot.report),
                    "retired_rollouts": snapshot.retired_rollouts,
                    "restored_pending": snapshot.restored_pending,
                    "facts": snapshot.facts,
                    "counters": snapshot.counters,
                    "boot_id": boot_id,
                    "lease_expires_at": snapshot.lease_expires_at,
                }
            )

    async def prepare(request: Request) -> JSONResponse:
        if not authorized(request):
            return JSONResponse({"error": {"reason": "TOKEN_INVALID"}}, status_code=401)
        with observer.operation("Prepare", request.headers.items()) as operation:
            body = json.loads(await request.body())
            operation.checkpoint(body["checkpoint_id"])
            try:
                updates = await control.prepare(body["checkpoint_id"], float(body["deadline"]))
                final = None
                async for update in updates:
                    final = update
            except CheckpointError as error:
                operation.refused(error.reason.value)
                return _refused(error)
            assert final is not None
            return JSONResponse(_update(final))

    app.add_api_route(f"{CONTROL}/status", status, methods=["GET"])
    app.add_api_route(f"{CONTROL}/prepare", prepare, methods=["POST"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_server")
    parser.add_argument("--token", required=True)
    parser.add_argument("--instance", default="counter")
    parser.add_argument("--http-address", default="127.0.0.1:0")
    args = parser.parse_args(argv)
    settings = CheckpointSettings(enabled=True, token=args.token, instance=args.instance)
    server = ControlRouteCounter(ResourcesServerConfig(instance=args.instance, checkpoint=settings))
    app = server.build_app()
    runtime = server.runtime
    assert runtime is not None
    add_control_routes(app, runtime.control, args.token, runtime.sidecar.servicer.boot_id)
    host, _, port = args.http_address.rpartition(":")

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            bound = self.servers[0].sockets[0].getsockname()
            print(
                json.dumps(
                    {
                        "http": f"{host}:{bound[1]}",
                        "grpc": runtime.address,
                        "instance": args.instance,
                        "kind": "resources",
                        "pid": os.getpid(),
                    }
                ),
                flush=True,
            )

    config = uvicorn.Config(app, host=host, port=int(port), lifespan="on", log_level="warning")
    Announcing(config).run()


if __name__ == "__main__":
    sys.exit(main())
