"""The fast JSON paths: orjson encoding as strict as the standard library's, already-encoded
states spliced into records, msgspec decoding, decoded states installed as they are, and the
collector paused around a restore's decode."""

from __future__ import annotations

import enum
import gc
import json
import threading

import pytest

from rollout_checkpoint.server.core.episodes import EpisodeId
from rollout_checkpoint.server.core.errors import CheckpointError, Reason
from rollout_checkpoint.server.core.layout import load_json
from rollout_checkpoint.server.resources import InvalidSessionState
from rollout_checkpoint.server.resources.json_state import EnvironmentStates
from rollout_checkpoint.server.resources.participant import DecodedSessionStates
from rollout_checkpoint.server.runtime.collector import collection_paused
from rollout_checkpoint.server.runtime.participant import ExportRecord
from rollout_checkpoint.server.runtime.records_codec import (
    EncodedJSON,
    encode_json,
    restored_record,
    serialize_records,
)


class Text(str):
    pass


class Level(enum.IntEnum):
    HIGH = 3


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def stdlib(value: object) -> bytes:
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "value",
    [
        {"b": [1, 2.5, None, True, -0.0, 1e16], "a": {"x": "é \u2028 \U0001f600"}},
        2**80,
        {"deep": [{"n": -(2**70)}]},
        {"a": {1: "x", None: "y"}},  # the standard library writes such keys as strings
        [Text("subclass"), Level.HIGH],
        "null",
        nested(300),  # deeper than orjson goes: the standard library writes it
    ],
)
def test_encode_json_writes_what_the_standard_library_writes(value: object) -> None:
    assert encode_json(value) == stdlib(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        ({"a": [None, {"b": float("-inf")}]}, ValueError),
        ({1, 2}, TypeError),
        ("half a pair: \ud800", ValueError),
        (b"bytes", TypeError),
    ],
)
def test_encode_json_refuses_what_the_standard_library_refuses(
    value: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        encode_json(value)


def test_an_encoded_state_is_stored_as_it_is() -> None:
    state = EncodedJSON(b'{"schema_version":1,"environment":{"z":1,"a":[2]}}')
    records = [ExportRecord(EpisodeId("r1", 2), {"session_id": "s1", "state": state})]
    [line] = serialize_records(records)
    assert line == (
        b'{"episode_id":{"rollout_id":"r1","attempt":2},"session_id":"s1",'
        b'"state":{"schema_version":1,"environment":{"z":1,"a":[2]}}}'
    )
    assert json.loads(line)["state"]["environment"] == {"z": 1, "a": [2]}


@pytest.mark.parametrize("data", [b'{"a":\n1}', b'{"a":\r1}'])
def test_an_encoded_state_with_a_line_break_is_unserializable_naming_the_episode(
    data: bytes,
) -> None:
    records = [ExportRecord(EpisodeId("r1"), {"state": EncodedJSON(data)})]
    with pytest.raises(CheckpointError) as caught:
        list(serialize_records(records))
    assert caught.value.reason is Reason.UNSERIALIZABLE_STATE
    assert caught.value.metadata["captureKey"] == "r1"


def test_load_json_keeps_big_integers_and_refuses_what_no_writer_writes() -> None:
    assert load_json(b'{"n":123456789012345678901234567890,"n":1}') == {"n": 1}
    assert load_json(b"[123456789012345678901234567890]") == [123456789012345678901234567890]
    for text in (b"NaN", b"[1e999]", b'"\\ud800"', b"\xef\xbb\xbf[1]", b"[1,", b"[" * 5000):
        with pytest.raises(ValueError, match=r"."):
            load_json(text)


def test_a_restored_record_takes_the_decoded_dict_over() -> None:
    raw = load_json(b'{"episode_id":{"rollout_id":"r","attempt":1},"session_id":"s","state":{}}')
    record = restored_record(raw)
    assert record.checkpointed == EpisodeId("r", 1) and record.fields is raw
    assert dict(record.fields) == {"session_id": "s", "state": {}}


async def test_decoded_states_install_as_they_are_and_their_shape_is_still_checked() -> None:
    environments: dict[str, object] = {}
    hooks = EnvironmentStates(environments)
    environment = {"a": [1]}
    await hooks.restore_session_states(
        DecodedSessionStates(s1={"schema_version": 1, "environment": environment})
    )
    assert environments["s1"] is environment  # no copy: nothing else holds decoded state
    with pytest.raises(InvalidSessionState) as caught:
        await hooks.restore_session_states(
            DecodedSessionStates(
                ok={"schema_version": 1, "environment": {}}, bad={"environment": {}}
            )
        )
    assert caught.value.session_id == "bad" and list(environments) == ["s1"]
    copied = {"b": 2}
    await hooks.restore_session_states({"s2": {"schema_version": 1, "environment": copied}})
    assert environments["s2"] == copied and environments["s2"] is not copied


async def test_an_export_is_encoded_json_of_the_state_at_the_call() -> None:
    environments: dict[str, object] = {f"s{i}": {"i": i, "big": 2**70} for i in range(600)}
    states = await EnvironmentStates(environments).export_session_states([*environments, "gone"])
    assert list(states) == list(environments)
    assert json.loads(states["s599"].data) == {
        "schema_version": 1,
        "environment": {"i": 599, "big": 2**70},
    }


def test_the_collector_is_paused_across_overlapping_blocks_and_restored_after() -> None:
    assert gc.isenabled()
    entered = threading.Event()
    release = threading.Event()

    def other() -> None:
        with collection_paused():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with collection_paused():
        thread.start()
        assert entered.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other block still runs
    release.set()
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_the_worker_an_earlier_multi_worker_server_wrote_is_dropped_on_read() -> None:
    """Its checkpoints restore into one process or any number of workers alike: every
    install path receives the fields a one-process server writes."""
    raw = load_json(
        b'{"episode_id":{"rollout_id":"r","attempt":0},"session_id":"s","state":{},"worker":2}'
    )
    assert dict(restored_record(raw).fields) == {"session_id": "s", "state": {}}


@pytest.mark.parametrize("field", ["episode_id", "worker"])
def test_a_record_using_a_reserved_field_is_unserializable_naming_the_episode(field: str) -> None:
    records = [ExportRecord(EpisodeId("r1"), {"state": {}, field: 1})]
    with pytest.raises(CheckpointError, match=f"reserved field {field}") as caught:
        list(serialize_records(records))
    assert caught.value.reason is Reason.UNSERIALIZABLE_STATE
    assert caught.value.metadata["captureKey"] == "r1"
