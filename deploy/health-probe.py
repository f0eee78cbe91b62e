#!/usr/bin/env python3
"""A gRPC health probe over TLS, for Kubernetes exec probes: exits 0 only for SERVING.

    rollout-checkpoint-health-probe --address localhost:9000 \\
        --ca-file /etc/rollout-checkpoint-tls/ca.crt participant-readiness

The kubelet's native `grpc:` probe speaks plaintext only, and a participant whose sidecar has a
certificate (ROLLOUT_CHECKPOINT_TLS_CERT_FILE) serves TLS only, on one port, health included.
This script calls grpc.health.v1.Health/Check over TLS instead, verifying the server against
`--ca-file` for the host of `--address` (so the certificate must name it: `localhost` for a
probe of the pod's own sidecar). Health needs no token.

Exit codes: 0 SERVING; 1 any other answer (NOT_SERVING, an unknown service name), or no answer
(refused, TLS failure, timeout); 2 a usage error (the CA file cannot be read). One line on
stderr says why, which the kubelet records in the pod's events.

deploy/Dockerfile installs it as /usr/local/bin/rollout-checkpoint-health-probe;
tests/test_kubernetes.py runs it against a real sidecar with the README's certificate.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROG = "rollout-checkpoint-health-probe"


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    result.add_argument("service", help='the health service name ("" for the whole server)')
    result.add_argument("--address", required=True, help="HOST:PORT; HOST must be in the cert")
    result.add_argument("--ca-file", required=True, help="PEM CA bundle to verify the server")
    result.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with open(args.ca_file, "rb") as file:
            ca = file.read()
    except OSError as error:
        print(f"{PROG}: cannot read --ca-file: {error}", file=sys.stderr)
        return 2
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.secure_channel(args.address, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else None
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            name = code.name if code is not None else "ERROR"
            print(f"{PROG}: {args.service!r} at {args.address}: {name}: {details}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{PROG}: {args.service!r} at {args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
