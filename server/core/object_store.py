"""Checkpoint locations on an object store (`s3://bucket/prefix`, `gs://…`, `az://…`): the URL
rules, and one small blocking client over obstore that both sides use.

Shared by the participant runtime (its parts, `object_parts`) and the controller (publication,
`inspect`, `collect`), so it lives in core and imports nothing else of the runtime.

Why each rule exists:

* **The URL is checked like a path.** A checkpoint URL names a bucket and a key prefix; a
  `..`, an empty or a `.` component, a query, a fragment or user info is refused, so the keys
  a participant writes are exactly `<prefix>/participants/<kind>/<instance>/…` and nothing
  else: object stores have no directories, and a key with `../` in it is just a key another
  reader would resolve differently. Allowed roots apply to URLs too (`allowed_url`).
* **Credentials only from the environment** (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  `AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ALLOW_HTTP`, or the instance/pod identity chain that
  obstore follows): a URL carries none, and a URL with user info is refused, so a fleet file,
  a request or a reply never holds a secret. Every error message that leaves here is built
  from the failing operation and the error's type, with any credential value found in the
  library's text masked (`safe_message`), so a log line or a gRPC status never echoes one.
* **Bounded retries.** obstore retries a failed request for up to three minutes by default;
  a commit whose store is down must fail within its deadline (STORAGE_FAILED, retryable)
  instead, so retries are bounded here (`RETRY_SECONDS`). A store that accepts connections and
  never answers is not retried at all: one request waits `REQUEST_SECONDS` (sized for a large
  upload), so every caller that has a deadline bounds the call itself (a participant's Commit
  and Restore; a controller through `client.checkpointing.publication.bounded`).
* **obstore is imported lazily** (the optional `[s3]` extra): a local-only installation never
  needs it, and one that names a URL without it gets `extras.MissingExtra`, whose one line
  says which extra to install.

Everything here blocks (network I/O): callers run it in a thread.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rollout_checkpoint.server.core.extras import S3, require

OBJECT_SCHEMES = ("s3", "gs", "az")
"""URL schemes of object-store locations (all through obstore; only s3:// is tested, against
SeaweedFS)."""

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

CONNECT_SECONDS = 5.0
"""Bound on opening a connection to the store."""
REQUEST_SECONDS = 120.0
"""Bound on one request (a multipart part, a GET's whole body)."""
RETRY_SECONDS = 8.0
"""How long obstore retries a failed request before the operation fails (its default is three
minutes, far beyond any commit's deadline)."""
PART_SIZE = 8 * 1024 * 1024
"""Size of one part of a multipart upload; a records object larger than this is uploaded in
parts, `UPLOAD_CONCURRENCY` at a time."""
UPLOAD_CONCURRENCY = 8
READ_CHUNK = 4 * 1024 * 1024
"""Chunk size of a streamed GET: records are hashed as they arrive, never held whole."""

_ENV = ("AWS_", "GOOGLE_", "AZURE_")
_SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_CLIENT_SECRET",
)


def is_object_url(location: str) -> bool:
    """Whether a checkpoint location is an object-store URL (`s3://…`, `gs://…`, `az://…`)."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme in OBJECT_SCHEMES


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """A checked object-store location: a bucket and a key prefix (no leading/trailing `/`)."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        base = f"{self.scheme}://{self.bucket}"
        return f"{base}/{self.prefix}" if self.prefix else base

    def key(self, *names: str) -> str:
        """The key of `names` below the prefix."""
        return "/".join(p for p in (self.prefix, *names) if p)

    def child(self, *names: str) -> ObjectLocation:
        """The location `names` below this one."""
        return ObjectLocation(self.scheme, self.bucket, self.key(*names))

    def contains(self, other: ObjectLocation) -> bool:
        """Whether `other` is this location or lies below it."""
        if (self.scheme, self.bucket) != (other.scheme, other.bucket):
            return False
        return (
            not self.prefix
            or other.prefix == self.prefix
            or other.prefix.startswith(self.prefix + "/")
        )

    def split(self) -> tuple[ObjectLocation, str] | None:
        """The location this one lies in and its own name; None at the top of a bucket,
        which lies in no location of that bucket (so has no siblings)."""
        if not self.prefix:
            return None
        parent, _, name = self.prefix.rpartition("/")
        return ObjectLocation(self.scheme, self.bucket, parent), name

    def __str__(self) -> str:
        return self.url


def parse_object_url(raw: str) -> ObjectLocation:
    """Parse and check an object-store URL; ValueError says what is wrong.

    `scheme://bucket[/prefix]` with a known scheme, a plain bucket name and prefix components
    that are plain names (no `.`/`..`, no empty component, no query, fragment or user info):
    the keys written below it are then exactly the ones a reader derives."""
    if "\x00" in raw:
        raise ValueError("must not contain NUL")
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme not in OBJECT_SCHEMES:
        raise ValueError(f"must start with one of {', '.join(s + '://' for s in OBJECT_SCHEMES)}")
    if any(c in rest for c in "?#@\\") or any(c.isspace() for c in rest):
        raise ValueError("must not contain a query, a fragment, user info or whitespace")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"bucket {bucket!r} is not a valid bucket name")
    prefix = prefix.rstrip("/")
    components = prefix.split("/") if prefix else []
    for component in components:
        if component in ("", ".", "..") or not _COMPONENT.fullmatch(component):
            raise ValueError(
                f"prefix component {component!r} is not a plain name "
                f"({_COMPONENT.pattern}; no empty, '.' or '..' component)"
            )
    return ObjectLocation(scheme, bucket, prefix)


def allowed_url(location: ObjectLocation, allowed_roots: Sequence[str]) -> bool:
    """Whether `location` lies under an allowed root: with no roots at all anything is allowed
    (as for paths); otherwise only below a root that is itself an object URL."""
    if not allowed_roots:
        return True
    return any(root.contains(location) for root in _url_roots(allowed_roots))


def _url_roots(allowed_roots: Sequence[str]) -> Iterator[ObjectLocation]:
    """The allowed roots that are valid object URLs (a path root never admits a URL)."""
    for root in allowed_roots:
        if is_object_url(root):
            try:
                yield parse_object_url(root)
            except ValueError:
                continue


def strictly_below_allowed_root(location: ObjectLocation, allowed_roots: Sequence[str]) -> bool:
    """Whether `location` lies strictly below an allowed root (any location when none are
    set): then its parent prefix, where a chained part's sibling references resolve, is
    inside that root. A checkpoint at a root itself would send its references beside it,
    outside every allowed root (another tenant's prefix)."""
    if not allowed_roots:
        return True
    return any(
        root.contains(location) and root.prefix != location.prefix
        for root in _url_roots(allowed_roots)
    )


class ObjectStoreFailure(Exception):
    """An object-store operation failed (unreachable, refused credentials, a server error).

    The message names the operation, the key and the error's type, never a credential."""

    def __init__(self, operation: str, url: str, cause: BaseException) -> None:
        self.operation = operation
        self.url = url
        self.error_type = type(cause).__name__
        self.credentials_refused = self.error_type in (
            "PermissionDeniedError",
            "UnauthenticatedError",
        )
        detail = (
            "the store refused the credentials from the environment"
            if self.credentials_refused
            else safe_message(cause)
        )
        super().__init__(f"object store {operation} {url} failed ({self.error_type}): {detail}")


def safe_message(error: BaseException, limit: int = 300) -> str:
    """The error's text, first line only, with every credential value from the environment
    masked, and bounded: library messages may quote request details."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return text[:limit]


def _obstore() -> Any:
    require(S3, "object-store checkpoint locations (s3://, gs://, az://)")
    import obstore

    return obstore


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object's bytes and its version (what a compare-and-swap names)."""

    data: bytes
    e_tag: str | None
    version: str | None


@dataclass(frozen=True, slots=True)
class ListedObject:
    key: str
    size: int
    last_modified: datetime


class ObjectStoreClient:
    """A blocking client for one bucket (obstore's sync API; call it from a thread).

    obstore's Rust client is thread-safe and pools connections, so one client per bucket is
    shared by every thread of the process (`client_for`)."""

    def __init__(self, scheme: str, bucket: str) -> None:
        obstore = _obstore()
        self.scheme = scheme
        self.bucket = bucket
        self._obstore = obstore
        self._exceptions = obstore.exceptions
        options: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=CONNECT_SECONDS),
            "timeout": timedelta(seconds=REQUEST_SECONDS),
        }
        if scheme == "s3" and _truthy(os.environ.get("AWS_ALLOW_HTTP")):
            options["allow_http"] = True
        retry = {
            "max_retries": 3,
            "retry_timeout": timedelta(seconds=RETRY_SECONDS),
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        extra: dict[str, Any] = {}
        if scheme == "s3":
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                # A custom endpoint (MinIO, SeaweedFS, …) is addressed path-style.
                extra["virtual_hosted_style_request"] = False
        try:
            self._store = obstore.store.from_url(
                f"{scheme}://{bucket}", client_options=options, retry_config=retry, **extra
            )
        except Exception as exc:
            raise ObjectStoreFailure("configure", f"{scheme}://{bucket}", exc) from None

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def _failure(self, operation: str, key: str, exc: BaseException) -> ObjectStoreFailure:
        return ObjectStoreFailure(operation, self.url(key), exc)

    def get(self, key: str, limit: int | None = None) -> StoredObject | None:
        """The object's bytes and version; None when there is no such object. `ValueError`
        when it is larger than `limit` (checked before its body is read)."""
        try:
            result = self._obstore.get(self._store, key)
            meta = result.meta
            if limit is not None and meta["size"] > limit:
                raise ValueError(f"{self.url(key)} is larger than {limit} bytes")
            data = bytes(result.bytes())
        except (FileNotFoundError, self._exceptions.NotFoundError):
            return None
        except ValueError:
            raise
        except Exception as exc:
            raise self._failure("GET", key, exc) from None
        return StoredObject(data, meta.get("e_tag"), meta.get("version"))

    def stream(self, key: str) -> tuple[int, Iterator[bytes]] | None:
        """The object's size and an iterator over its bytes in chunks; None when missing.
        A failure while iterating raises `ObjectStoreFailure`."""
        try:
            result = self._obstore.get(self._store, key)
            size = int(result.meta["size"])
        except (FileNotFoundError, self._exceptions.NotFoundError):
            return None
        except Exception as exc:
            raise self._failure("GET", key, exc) from None

        def chunks() -> Iterator[bytes]:
            try:
                for chunk in result.stream(min_chunk_size=READ_CHUNK):
                    yield bytes(chunk)
            except Exception as exc:
                raise self._failure("GET", key, exc) from None

        return size, chunks()

    def _head(self, key: str) -> Any:
        """The object's metadata, read by one HEAD (no body); None when there is no such object."""
        try:
            return self._obstore.head(self._store, key)
        except (FileNotFoundError, self._exceptions.NotFoundError):
            return None
        except Exception as exc:
            raise self._failure("HEAD", key, exc) from None

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def size(self, key: str) -> int | None:
        """The object's size (one HEAD); None when there is no such object."""
        meta = self._head(key)
        return None if meta is None else int(meta["size"])

    def tag(self, key: str) -> str | None:
        """What changes with every write of the object, read by one HEAD (no body): its ETag,
        else its version, else its modification time and size (a store that reports neither
        must still never look unchanged after a write); None when there is no such object."""
        meta = self._head(key)
        if meta is None:
            return None
        tag = meta.get("e_tag") or meta.get("version")
        return str(tag) if tag else f"{meta.get('last_modified')}/{meta.get('size')}"

    def put(self, key: str, data: bytes | Iterable[bytes], *, size: int) -> None:
        """Write (or overwrite) an object; one request up to `PART_SIZE`, beyond it a
        multipart upload of `UPLOAD_CONCURRENCY` parts at a time. A multipart upload that
        fails is aborted: nothing becomes readable under `key`."""
        try:
            self._obstore.put(
                self._store,
                key,
                data,
                use_multipart=size > PART_SIZE,
                chunk_size=PART_SIZE,
                max_concurrency=UPLOAD_CONCURRENCY,
            )
        except Exception as exc:
            raise self._failure("PUT", key, exc) from None

    def create(self, key: str, data: bytes) -> bool:
        """Create the object only if absent (`If-None-Match: *`); False when one exists."""
        try:
            self._obstore.put(self._store, key, data, mode="create", use_multipart=False)
        except self._exceptions.AlreadyExistsError:
            return False
        except self._exceptions.PreconditionError:
            return False
        except Exception as exc:
            raise self._failure("PUT (create)", key, exc) from None
        return True

    def swap(self, key: str, data: bytes, current: StoredObject | None) -> bool:
        """Replace the object only if it is still `current` (`If-Match` on its ETag or
        version; `If-None-Match: *` when `current` is None). False when another writer got
        there first: the caller reads again and decides again."""
        mode: Any = "create"
        if current is not None:
            mode = {
                name: value
                for name, value in (("e_tag", current.e_tag), ("version", current.version))
                if value is not None
            }
        try:
            self._obstore.put(self._store, key, data, mode=mode, use_multipart=False)
        except (self._exceptions.AlreadyExistsError, self._exceptions.PreconditionError):
            return False
        except Exception as exc:
            raise self._failure("PUT (compare-and-swap)", key, exc) from None
        return True

    def list_below(self, prefix: str) -> list[ListedObject]:
        """Every object below `prefix/` (recursively)."""
        try:
            listed: list[ListedObject] = []
            for batch in self._obstore.list(self._store, prefix + "/", chunk_size=1000):
                for meta in batch:
                    listed.append(ListedObject(meta["path"], meta["size"], meta["last_modified"]))
            return listed
        except Exception as exc:
            raise self._failure("LIST", prefix + "/", exc) from None

    def children(self, prefix: str) -> list[str]:
        """The names of the "directories" directly below `prefix/` (common prefixes)."""
        try:
            result = self._obstore.list_with_delimiter(
                self._store, prefix + "/" if prefix else None
            )
        except Exception as exc:
            raise self._failure("LIST", prefix + "/", exc) from None
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"])

    def copy(self, source: str, target: str) -> None:
        """Copy an object to `target` within the bucket, server-side (no byte passes through
        this process: what sets aside an object too large to read)."""
        try:
            self._obstore.copy(self._store, source, target)
        except Exception as exc:
            raise self._failure("COPY", source, exc) from None

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            self._obstore.delete(self._store, list(keys))
        except (FileNotFoundError, self._exceptions.NotFoundError):
            return
        except Exception as exc:
            raise self._failure("DELETE", keys[0], exc) from None


_clients: dict[tuple[str, ...], ObjectStoreClient] = {}
_clients_lock = threading.Lock()


def client_for(location: ObjectLocation) -> ObjectStoreClient:
    """The process's client for the location's bucket (created on first use; a new one when
    the environment's store variables changed, so a rotated key is picked up)."""
    environment = tuple(
        f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith(_ENV)
    )
    key = (location.scheme, location.bucket, *environment)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = ObjectStoreClient(location.scheme, location.bucket)
        return client


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")
