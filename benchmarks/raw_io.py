"""The raw limit: the same states serialized, written and fsynced, and read back and parsed,
by a plain script with no control plane (no gRPC, no hashing, no validation, no hooks).

    python -m benchmarks.raw_io write --sessions 10000 --bytes 5000 --path /tmp/x/records.jsonl
    python -m benchmarks.raw_io read --path /tmp/x/records.jsonl

    python -m benchmarks.raw_io write --codec fast ...   # orjson to write, msgspec to read

Each prints one JSON line: `seconds` (the timed part only), `bytes`, `records`. The read keeps
every parsed record in memory, as a restore must. The states are generated before the clock starts (`states.py`, identical to what the benchmark seeded into
the server); the lines have the shape the participant stores (`episode_id`, `session_id`,
`state`), serialized with the same JSON options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from .states import environment, session_state

CHUNK = 1 << 20


def records(sessions: int, size: int, prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "episode_id": {"rollout_id": f"{prefix}{i:05d}", "attempt": 1},
            "session_id": uuid.UUID(int=i).hex,
            "state": session_state(environment(i, size)),
        }
        for i in range(sessions)
    ]


def _stdlib_line(row: dict[str, Any]) -> bytes:
    return json.dumps(row, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()


def encoder(codec: str) -> Callable[[dict[str, Any]], bytes]:
    """The standard library's (the reference), or orjson's (the libraries the runtime uses)."""
    if codec == "fast":
        import orjson

        return orjson.dumps
    return _stdlib_line


def decoder(codec: str) -> Callable[[bytes], Any]:
    if codec == "fast":
        import msgspec

        return msgspec.json.Decoder().decode
    return json.loads


def write(path: str, rows: list[dict[str, Any]], codec: str = "stdlib") -> dict[str, Any]:
    encode = encoder(codec)
    started = time.perf_counter()
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb", buffering=CHUNK) as out:
        for row in rows:
            line = encode(row) + b"\n"
            out.write(line)
            size += len(line)
        out.flush()
        os.fsync(out.fileno())
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return {"seconds": time.perf_counter() - started, "bytes": size, "records": len(rows)}


def read(path: str, codec: str = "stdlib") -> dict[str, Any]:
    """Read and parse every line, keeping the parsed records (a restore must hold them all:
    that is what makes the cyclic garbage collector rescan the growing heap)."""
    decode = decoder(codec)
    started = time.perf_counter()
    size = 0
    kept: list[Any] = []
    with open(path, "rb", buffering=CHUNK) as source:
        for line in source:
            kept.append(decode(line))
            size += len(line)
    return {"seconds": time.perf_counter() - started, "bytes": size, "records": len(kept)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.raw_io")
    parser.add_argument("mode", choices=["write", "read"])
    parser.add_argument("--path", required=True)
    parser.add_argument("--sessions", type=int, default=0)
    parser.add_argument("--bytes", type=int, default=5000, help="target JSON size of a state")
    parser.add_argument("--prefix", default="t", help="rollout ids are <prefix><index>")
    parser.add_argument("--codec", choices=["stdlib", "fast"], default="stdlib")
    args = parser.parse_args(argv)
    if args.mode == "write":
        result = write(args.path, records(args.sessions, args.bytes, args.prefix), args.codec)
    else:
        result = read(args.path, args.codec)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
