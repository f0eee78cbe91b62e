"""A real S3 server for the object-store tests: SeaweedFS (`weed server -s3`) on 127.0.0.1.

Why a real server and not a mock: the guarantees the object-store backend rests on
(`If-None-Match: *` refusing a second create, `If-Match` compare-and-swap on an ETag,
multipart uploads that leave nothing readable when aborted, signature checks) are exactly
what an in-process mock would get right by construction. SeaweedFS implements them
independently, so the tests find out whether they really hold.

How a suite uses it (a plain module, so any test module or conftest can import it):

    from . import s3_server as s3_support
    from .s3_server import SeaweedS3

    s3_server = s3_support.s3_server_fixture  # registers the `s3_server` fixture here

    async def test_x(s3_server: SeaweedS3) -> None:
        c = s3_server.connection     # endpoint, region, keys, bucket
        ...

`s3_server` is session-scoped, but pytest keys a fixture by where it is registered: a module
that re-exports it gets its own server. Once several modules use it, re-export it once from
tests/conftest.py instead, so the whole run shares one server (~10 s to start).

`kill()` and `restart()` work on the session's server (same endpoint, keys and data after a
restart; ~17 s, because SeaweedFS holds writes for a 15 s warm-up after its master starts with
volumes already on disk, and `start()` returns only once a write has gone through). A test
that leaves the server dead, or must not share it, owns one: `with running_seaweedfs(tmp_path)
as server: ...`.

Every listener (master, volume, filer, S3, and their gRPC ports) is on 127.0.0.1 on a free
port chosen at start; the data lives under the given work directory; the server runs in its
own process group, killed as a group at teardown whatever happens. The `weed` binary comes
from `scripts/seaweedfs` (built and cached on first use), or from $ROLLOUT_CHECKPOINT_WEED;
if neither works the fixture fails with the reason, it never skips.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from rollout_checkpoint.client.fleet.ports import restartable_ports

REPO = Path(__file__).resolve().parent.parent
SEAWEEDFS_SCRIPT = REPO / "scripts" / "seaweedfs"
WEED_ENV = "ROLLOUT_CHECKPOINT_WEED"
"""Path of a `weed` binary to use instead of `scripts/seaweedfs`'s cached build."""

START_TIMEOUT_SECONDS = 90.0
"""Bound on one start. Measured on 2 shared cores: ready ~10 s after a first start (the S3
gateway waits 2 s before starting; writes wait ~8 s for the filer to join the master's lock
ring), ~17 s after a restart (the master's 15 s warm-up). The margin is for a loaded machine."""
BUILD_TIMEOUT_SECONDS = 40 * 60.0
"""Bound on building `weed` when the cache is cold (8 minutes on 2 idle cores, 20.5 measured
on 2 cores shared with other builds)."""
PROBE_TIMEOUT_SECONDS = 3.0
"""Bound on one readiness request: while the master has no leader a request hangs rather than
fails, and a short bound lets the next probe go out as soon as the cluster can answer it."""
PORT_ATTEMPTS = 3
REGION = "us-east-1"
PROBE_KEY = "_s3_server_readiness_probe"
"""Written, read back and deleted to prove the data path (filer + volume server) works, not
just the S3 listener: the first write has to wait for the master to grow volumes."""

_PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)


@dataclass(frozen=True)
class S3Connection:
    """What a client needs to reach the server: plain HTTP, path-style, static keys."""

    endpoint: str
    region: str
    access_key_id: str
    secret_access_key: str
    bucket: str

    def url(self, prefix: str = "") -> str:
        """`s3://bucket/prefix`: the form checkpoint locations take."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def environment(self) -> dict[str, str]:
        """The standard variables (the only place credentials come from in production), for a
        subprocess under test. AWS_ALLOW_HTTP is object_store's switch for a plain-HTTP
        endpoint; AWS_EC2_METADATA_DISABLED keeps botocore-based tools off 169.254.169.254."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }


@dataclass(frozen=True)
class RawResponse:
    """One response of `SeaweedS3.request`."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class SeaweedFSUnavailable(RuntimeError):
    """No `weed` binary could be had, or it did not start: the message says why."""


def weed_binary() -> Path:
    """The `weed` binary: $ROLLOUT_CHECKPOINT_WEED if set, else `scripts/seaweedfs`'s cached
    build (built now if the cache is cold; its progress goes to this process's stderr)."""
    override = os.environ.get(WEED_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SeaweedFSUnavailable(f"${WEED_ENV}={override} is not an executable file")
        return path
    try:
        done = subprocess.run(
            ["bash", str(SEAWEEDFS_SCRIPT)],
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            timeout=BUILD_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise SeaweedFSUnavailable(
            f"scripts/seaweedfs did not finish in {BUILD_TIMEOUT_SECONDS:.0f}s"
        ) from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SeaweedFSUnavailable(
            f"scripts/seaweedfs exited {done.returncode} without a weed binary "
            "(its error is on stderr above)"
        )
    path = Path(lines[-1])
    if not os.access(path, os.X_OK):
        raise SeaweedFSUnavailable(f"scripts/seaweedfs printed {path}, which is not executable")
    return path


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free on 127.0.0.1 a moment ago, below the ephemeral
    range (`client/fleet/ports.py`: a server restarted on its port must find it free again).
    The gRPC ports are chosen too: weed's default (HTTP port + 10000) overflows 65535 for
    ports from the ephemeral range."""
    return restartable_ports(count)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()


def sigv4_headers(
    method: str,
    url: str,
    body: bytes,
    *,
    region: str,
    access_key_id: str,
    secret_access_key: str,
    now: datetime.datetime | None = None,
) -> dict[str, str]:
    """AWS Signature Version 4 headers for one S3 request (stdlib only); `url`'s path must be
    URI-encoded already (as `SeaweedS3.request` builds it).

    Why hand-written: the fixture must create its bucket and prove readiness without depending
    on the client library under test (and the benchmark compares several), so the server is
    set up the same way whichever client a suite then uses.
    """
    parts = urllib.parse.urlsplit(url)
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    payload = _sha256(body)
    query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
        for k, v in sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    )
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            parts.path or "/",  # already URI-encoded, once, as S3 signs it
            query,
            "".join(f"{name}:{headers[name]}\n" for name in sorted(headers)),
            signed,
            payload,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, _sha256(canonical.encode())])
    key = _hmac(f"AWS4{secret_access_key}".encode(), day)
    for part in (region, "s3", "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key_id}/{scope}, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    return headers


class SeaweedS3:
    """One `weed server -s3` process group with its ports and data directory.

    The ports and the keys are chosen once, so `restart()` brings the same endpoint back over
    the same data (a client built before the kill keeps working after it).
    """

    def __init__(self, weed: Path, work: Path, *, bucket: str = "checkpoints") -> None:
        self.weed = weed
        self.work = work
        self.data = work / "data"
        self.log_path = work / "weed.log"
        self.config_path = work / "s3.json"
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        self.connection = S3Connection(
            endpoint=f"http://127.0.0.1:{self.ports['s3']}",
            region=REGION,
            access_key_id="AK" + secrets.token_hex(9).upper(),
            secret_access_key=secrets.token_urlsafe(30),
            bucket=bucket,
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.ready_once = False

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def filer_endpoint(self) -> str:
        """The filer's HTTP API: SeaweedFS's own view of the bucket (for checks that S3 cannot
        express, e.g. what an aborted multipart upload left under `/buckets/<b>/.uploads`)."""
        return f"http://127.0.0.1:{self.ports['filer']}"

    def command(self) -> list[str]:
        """The command line: every listener on 127.0.0.1, no default port, no telemetry."""
        p = self.ports
        return [
            str(self.weed),
            f"-logdir={self.work / 'logs'}",
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            "-master.telemetry=false",  # default on: would post to the vendor's collector
            # One master, so no vote can split: a short election timeout makes a restarted
            # master lead again in ~1 s instead of ~15 s (its state is resumed as usual:
            # without it, the volume server's topology id no longer matches and the master
            # freezes volume growth as after a state loss).
            "-master.electionTimeout=1s",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=64",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.work / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",  # defaults to the fixed port 8181
            "-s3.port.lance=0",  # defaults to the fixed port 9101
            f"-s3.localSocket={self.work / 's3.sock'}",
            f"-s3.config={self.config_path}",
            # Real S3 refuses a PUT to a missing bucket; SeaweedFS creates it by default.
            "-s3.autoCreateBucket=false",
        ]

    def _write_config(self) -> None:
        c = self.connection
        identities = {
            "identities": [
                {
                    "name": "rollout-checkpoint-tests",
                    "credentials": [
                        {"accessKey": c.access_key_id, "secretKey": c.secret_access_key}
                    ],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        self.config_path.write_text(json.dumps(identities, indent=2))
        self.config_path.chmod(0o600)
        # Read from the working directory. A fresh master holds its first volume allocation
        # for up to 15 s ("allocation_deferral": time for veteran volume servers of a rebuilt
        # master to report); here its one volume server is in the same process, so the hold
        # only delays the first write. "0s" disables it, as SeaweedFS's own scaffold suggests
        # for test setups.
        (self.work / "master.toml").write_text(
            '[master.volume_growth]\nallocation_deferral = "0s"\n'
        )

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Start the process group and return once the S3 API serves reads and writes (the
        bucket exists, a probe object round-trips). Raises SeaweedFSUnavailable, with the tail
        of weed's log, if it exits or is not ready within `timeout`.

        Before the first successful start, a port taken by another process between
        `free_ports()` and weed's bind is retried with fresh ports; after it the endpoint is
        fixed (clients hold it), so a restart keeps its ports."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start_once(timeout)
                self.ready_once = True
                return
            except SeaweedFSUnavailable:
                lost_race = "address already in use" in self.log_tail(400)
                if self.ready_once or not lost_race or attempt == PORT_ATTEMPTS:
                    raise
                # Never ready, so nothing to keep; and the master's raft state names the
                # old address, which the new one must not resume.
                shutil.rmtree(self.data, ignore_errors=True)
                self._remove_sockets()
                self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
                self.connection = replace(
                    self.connection, endpoint=f"http://127.0.0.1:{self.ports['s3']}"
                )

    def _start_once(self, timeout: float) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("SeaweedFS is already running")
        self.work.mkdir(parents=True, exist_ok=True)
        self.data.mkdir(exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self._write_config()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WEED_", "AWS_"))}
        # weed reads master.toml/filer.toml/security.toml from ., $HOME/.seaweedfs and
        # /etc/seaweedfs: cwd and HOME point at the work dir so no stray config applies.
        env["HOME"] = str(self.work)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {self.starts + 1}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.starts += 1
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Kill the whole process group (SIGKILL by default: a crash, nothing flushed) and
        reap it. The data directory stays, for `start()` again."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Kill and start again on the same ports, keys and data directory."""
        self.kill()
        self.start(timeout)

    def close(self) -> None:
        """Kill, and remove what weed leaves outside the work directory."""
        self.kill()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed also serves gRPC on Unix sockets at fixed paths under /tmp, named by port."""
        for name in ("master", "volume", "filer", "s3"):
            with contextlib.suppress(OSError):
                Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports[name + '_grpc']}.sock").unlink()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- raw S3 ---------------------------------------------------------------------------

    def request(
        self,
        method: str,
        key: str = "",
        *,
        body: bytes = b"",
        query: str = "",
        bucket: str | None = None,
        timeout: float = 10.0,
    ) -> RawResponse:
        """One signed S3 request to `/<bucket>/<key>?<query>`, independent of any client
        library (for set-up and for assertions about the server's own state, such as
        ListMultipartUploads)."""
        c = self.connection
        path = "/" + (bucket if bucket is not None else c.bucket)
        if key:
            path += "/" + key
        url = f"{c.endpoint}{urllib.parse.quote(path, safe='/-_.~')}"
        if query:
            url += "?" + query
        headers = sigv4_headers(
            method,
            url,
            body,
            region=c.region,
            access_key_id=c.access_key_id,
            secret_access_key=c.secret_access_key,
        )
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
        try:
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            return RawResponse(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            conn.close()

    def _wait_ready(self, deadline: float) -> None:
        last = "no answer yet"
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise SeaweedFSUnavailable(
                    f"weed exited ({code}) before it was ready; {self.log_path}:\n"
                    + self.log_tail()
                )
            try:
                last = self._probe()
                if last == "ready":
                    return
            except OSError as exc:  # not listening yet, or reset while starting
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise SeaweedFSUnavailable(
                    f"SeaweedFS was not ready in time (last: {last}); {self.log_path}:\n"
                    + self.log_tail()
                )
            time.sleep(0.1)

    def _probe(self) -> str:
        """One readiness step; 'ready' once the bucket exists and an object round-trips."""
        created = self.request("PUT", timeout=PROBE_TIMEOUT_SECONDS)
        if created.status not in (200, 409):  # 409: BucketAlreadyOwnedByYou after a restart
            return f"CreateBucket: HTTP {created.status} {created.body[:200]!r}"
        payload = secrets.token_bytes(16)
        put = self.request("PUT", PROBE_KEY, body=payload, timeout=PROBE_TIMEOUT_SECONDS)
        if put.status != 200:
            return f"PutObject: HTTP {put.status} {put.body[:200]!r}"
        got = self.request("GET", PROBE_KEY, timeout=PROBE_TIMEOUT_SECONDS)
        if got.status != 200 or got.body != payload:
            return f"GetObject: HTTP {got.status}"
        self.request("DELETE", PROBE_KEY, timeout=PROBE_TIMEOUT_SECONDS)
        return "ready"


@contextlib.contextmanager
def running_seaweedfs(work: Path, *, bucket: str = "checkpoints") -> Iterator[SeaweedS3]:
    """A server of one's own (for tests that kill it), killed on exit whatever happens."""
    server = SeaweedS3(weed_binary(), work, bucket=bucket)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """The session's S3 server (see the module docstring). Fails, never skips, when SeaweedFS
    cannot be built or started: a skipped object-store suite would read as a passing one."""
    server = _started_or_fail(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.close()


def _started_or_fail(work: Path) -> SeaweedS3:
    try:
        server = SeaweedS3(weed_binary(), work)
        server.start()
        return server
    except SeaweedFSUnavailable as exc:
        reason = str(exc)
    # Outside the except block, so the report is the reason alone, not a chained traceback.
    pytest.fail(f"no S3 server for the object-store tests: {reason}", pytrace=False)
