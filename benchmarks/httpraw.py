"""A minimal keep-alive HTTP/1.1 client over asyncio streams (loopback benchmarks only).

httpx costs a few hundred microseconds of Python per request on the client side, which on a
2-core machine competes with the server being measured. This client does the least a
benchmark needs: one connection, sequential requests, Content-Length or chunked replies, the
session cookie. It can also send a request's head now and its body later (a request held in
flight by its client, released at a moment the benchmark chooses).

Standard library only: the load-generator subprocess imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def cookie(self) -> str | None:
        """The first Set-Cookie as `name=value` (what the next request sends back)."""
        value = self.header("set-cookie")
        return value.split(";", 1)[0].strip() if value else None

    def json(self) -> Any:
        return json.loads(self.body)


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive connection to `host:port`; requests on it run one at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    async def open(cls, address: str) -> Connection:
        host, _, port = address.rpartition(":")
        connection = cls(host, int(port))
        await connection.connect()
        return connection

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.host, self.port, limit=1 << 22
        )

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._writer = None

    def head(
        self,
        method: str,
        path: str,
        length: int,
        *,
        cookie: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> bytes:
        lines = [
            f"{method} {path} HTTP/1.1",
            f"host: {self.host}:{self.port}",
            f"content-length: {length}",
        ]
        if length:
            lines.append("content-type: application/json")
        if cookie:
            lines.append(f"cookie: {cookie}")
        lines.extend(f"{k}: {v}" for k, v in headers)
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        cookie: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> Response:
        self.write(self.head(method, path, len(body), cookie=cookie, headers=headers) + body)
        return await self.read_response()

    def write(self, data: bytes) -> None:
        assert self._writer is not None, "not connected"
        self._writer.write(data)

    async def drain(self) -> None:
        assert self._writer is not None, "not connected"
        await self._writer.drain()

    async def read_response(self) -> Response:
        reader = self._reader
        assert reader is not None, "not connected"
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as error:
            raise HttpError("the server closed the connection") from error
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HttpError(f"not an HTTP/1.1 status line: {lines[0]!r}")
        headers = []
        for line in lines[1:]:
            if line:
                key, _, value = line.partition(":")
                headers.append((key.strip().lower(), value.strip()))
        response = Response(int(parts[1]), headers)
        length = response.header("content-length")
        if length is not None:
            response.body = await reader.readexactly(int(length))
        elif (response.header("transfer-encoding") or "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                chunk = await reader.readexactly(size + 2)
                if not size:
                    break
                chunks.append(chunk[:-2])
            response.body = b"".join(chunks)
        return response


def json_body(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
