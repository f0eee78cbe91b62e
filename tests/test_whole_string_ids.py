"""Ids are matched as whole strings: a trailing newline is refused everywhere.

Python's `re.match` with `$` also matches before a final newline, so `"ck\\n"` used to pass the
documented pattern `^[A-Za-z0-9][A-Za-z0-9._-]*$` here while a Go or Java controller applying
the same pattern refuses it. Every validator must agree with them: the participant's RPCs,
the data-plane rollout prefix, the settings, and the controller side (fleet file, coordinator,
publication).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_checkpoint.client.checkpointing.publication import (
    FleetManifest,
    PublishedParticipant,
    parse_time,
)
from rollout_checkpoint.client.coordinator.service import _check_id
from rollout_checkpoint.client.fleet import FleetConfigError, load_fleet_file
from rollout_checkpoint.client.participant import timestamp
from rollout_checkpoint.server.core.episodes import EpisodeId, is_valid_id, rollout_id_problem
from rollout_checkpoint.server.core.errors import CheckpointError
from rollout_checkpoint.server.core.layout import StoredManifest
from rollout_checkpoint.server.runtime.control_plane import ControlPlane
from rollout_checkpoint.server.runtime.rollout_prefix import RolloutPrefixMiddleware, episode_of
from rollout_checkpoint.server.runtime.settings import CheckpointSettings
from rollout_checkpoint.v1 import participant_service_pb2 as pb
from rollout_checkpoint.v1 import participant_service_pb2_grpc as pb_grpc
from rollout_checkpoint.v1 import types_pb2

from .conftest import TOKEN, Harness, drain, refused, serve_app
from .double import DoubleParticipant

NEWLINE_IDS = ["ck\n", "r-a1\n", "ck\r\n"]


@pytest.mark.parametrize("value", NEWLINE_IDS)
def test_the_shared_id_rules_refuse_a_trailing_newline(value: str) -> None:
    assert not is_valid_id(value)
    assert rollout_id_problem(value) is not None
    with pytest.raises(ValueError, match="rollout id"):
        EpisodeId(value)
    with pytest.raises(ValueError, match="rollout id"):
        EpisodeId.from_capture_key(value)


def test_a_capture_key_with_a_newline_after_its_attempt_is_not_that_attempt() -> None:
    with pytest.raises(ValueError, match="rollout id"):
        EpisodeId.from_capture_key("r-a1\n")
    assert EpisodeId.from_capture_key("r-a1") == EpisodeId("r", 1)


async def test_a_checkpoint_id_with_a_trailing_newline_is_an_invalid_request(
    harness: Harness,
) -> None:
    client, deadline = harness.client, harness.deadline()
    for call in (
        drain(client.prepare("ck\n", deadline)),
        client.renew("ck\n", deadline),
        client.resume("ck\n", deadline),
        client.retire("ck\n", deadline, [EpisodeId("r")]),
        client.forget("ck\n", deadline, ["r"]),
    ):
        error = await refused(call, "INVALID_REQUEST", "INVALID_ARGUMENT")
        assert error.metadata["field"] == "checkpoint_id"
    assert (await harness.client.get_status()).admission_open


async def test_rollout_ids_with_a_trailing_newline_are_invalid_requests(harness: Harness) -> None:
    client, deadline = harness.client, harness.deadline()
    error = await refused(client.forget("c1", deadline, ["r\n"]), "INVALID_REQUEST")
    assert error.metadata["field"] == "rollout_ids"
    # EpisodeId refuses the id on this side, so send the message as a foreign controller would.
    stub = pb_grpc.ParticipantServiceStub(client._channel)
    request = pb.RetireRequest(
        checkpoint_id="c1",
        deadline=timestamp(deadline),
        episodes=[types_pb2.EpisodeId(rollout_id="r\n", attempt=0)],
    )
    error = await refused(
        client._call(stub.Retire(request, metadata=client._call_metadata(), timeout=10)),
        "INVALID_REQUEST",
    )
    assert error.metadata["field"] == "episodes[0].rollout_id"


def echo_app() -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        episode = episode_of(request.scope)
        return JSONResponse({"capture_key": None if episode is None else episode.capture_key})

    app = Starlette(routes=[Route("/echo", echo, methods=["GET"])])
    app.add_middleware(RolloutPrefixMiddleware)
    return app


async def test_a_rollout_prefix_with_an_encoded_newline_is_refused() -> None:
    server, serving, port = await serve_app(echo_app())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            good = await http.get("/ng-rollout/r-a1/echo")
            assert good.status_code == 200 and good.json() == {"capture_key": "r-a1"}
            for key in ("r%0A", "r-a1%0A", "r%0D%0A"):
                reply = await http.get(f"/ng-rollout/{key}/echo")
                assert reply.status_code == 400, (key, reply.text)
                assert reply.json()["error"]["code"] == "invalid_rollout_prefix"
    finally:
        server.should_exit = True
        await serving


@pytest.mark.parametrize("instance", ["double\n", "double\r\n"])
def test_instance_names_with_a_trailing_newline_are_refused(instance: str) -> None:
    with pytest.raises(ValueError, match="instance"):
        CheckpointSettings(enabled=True, token=TOKEN, instance=instance)
    with pytest.raises(ValueError, match="instance"):
        ControlPlane(DoubleParticipant(instance))


def test_addresses_with_a_trailing_newline_are_refused() -> None:
    with pytest.raises(ValueError, match="grpc_address"):
        CheckpointSettings(enabled=True, token=TOKEN, grpc_address="127.0.0.1:0\n")


def test_the_coordinator_refuses_a_checkpoint_id_with_a_trailing_newline() -> None:
    with pytest.raises(CheckpointError) as caught:
        _check_id("ck\n")
    assert caught.value.reason == "INVALID_REQUEST" and caught.value.field == "checkpoint_id"


def test_a_fleet_file_member_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[[participants]]\nname = "env\\n"\naddress = "127.0.0.1:1"\n')
    with pytest.raises(FleetConfigError, match="name"):
        load_fleet_file(fleet, environ={"ROLLOUT_CHECKPOINT_TOKEN": TOKEN})


def test_published_manifests_refuse_values_with_a_trailing_newline() -> None:
    digest = "0" * 64
    for field in ("name", "kind", "instance"):
        values = {"name": "env", "kind": "environment", "instance": "env"} | {field: "x\n"}
        entry = PublishedParticipant(**values, manifest_sha256=digest)
        assert entry.problem() is not None, field
    entry = PublishedParticipant("env", "environment", "env", digest + "\n")
    assert entry.problem() is not None
    with pytest.raises(ValueError, match="created_at"):
        parse_time("2025-01-31T12:00:00Z\n")
    part = {
        "schema_version": 1,
        "kind": "environment",
        "instance": "env",
        "checkpoint_id": "c1",
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": 0,
        "bytes": 0,
    }
    StoredManifest.decode(_json(part))  # the well-formed part parses
    for field, value in (
        ("records_sha256", digest + "\n"),
        ("records_file", f"records-{digest}.jsonl\n"),
    ):
        with pytest.raises(ValueError, match=field):
            StoredManifest.decode(_json(part | {field: value}))
    good = FleetManifest.decode(_fleet_manifest("c1"))
    assert good.checkpoint_id == "c1"
    with pytest.raises(ValueError, match="checkpoint_id"):
        FleetManifest.decode(_fleet_manifest("c1\n"))


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _fleet_manifest(checkpoint_id: str) -> bytes:
    return _json(
        {
            "schema_version": 1,
            "checkpoint_id": checkpoint_id,
            "created_at": "2025-01-31T12:00:00.000000Z",
            "participants": [
                {
                    "name": "env",
                    "kind": "environment",
                    "instance": "env",
                    "manifest": "participants/environment/env/manifest.json",
                    "manifest_sha256": "0" * 64,
                }
            ],
            "continued": [],
            "controller_state": "",
        }
    )
