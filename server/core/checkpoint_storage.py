"""The one storage interface the participant runtime uses: a checkpoint location is a local
directory or an object-store URL, and the runtime never knows which.

`validate_checkpoint_location` checks a requested location against the allowed roots (paths
as before; URLs against the roots that are URLs), and `PartStorage` sends each part's write
and read to the backend the checked location belongs to. The guarantees are the same on both
(see `part_storage` and `object_parts`). Blocking: callers run it in a thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rollout_checkpoint.server.core.errors import invalid_request
from rollout_checkpoint.server.core.layout import PartChain, StoredManifest
from rollout_checkpoint.server.core.object_parts import ObjectPartStorage
from rollout_checkpoint.server.core.object_store import (
    allowed_url,
    is_object_url,
    parse_object_url,
)
from rollout_checkpoint.server.core.part_storage import (
    CheckpointStorage,
    LocalStorage,
    PublishedPart,
    WriteFence,
    validate_checkpoint_dir,
)


def validate_checkpoint_location(raw: str, allowed_roots: Sequence[str]) -> str:
    """The checked location: a URL in its canonical form, or a directory's real path.

    A URL must parse (`object_store.parse_object_url`) and lie below an allowed root that is
    a URL when any roots are set (a path root never admits a URL, nor a URL root a path).
    Refusals are INVALID_REQUEST naming `checkpoint_dir`."""
    if is_object_url(raw):
        try:
            location = parse_object_url(raw)
        except ValueError as exc:
            raise invalid_request("checkpoint_dir", str(exc)) from exc
        if not allowed_url(location, allowed_roots):
            raise invalid_request("checkpoint_dir", "lies outside the allowed checkpoint roots")
        return location.url
    local_roots = [root for root in allowed_roots if not is_object_url(root)]
    if allowed_roots and not local_roots:
        raise invalid_request("checkpoint_dir", "lies outside the allowed checkpoint roots")
    return validate_checkpoint_dir(raw, local_roots)


def allowed_root_locations(allowed_roots: Sequence[str]) -> frozenset[str]:
    """The allowed roots in the form `validate_checkpoint_location` returns a location
    (real paths, canonical URLs): a checkpoint at one of them has no sibling inside any
    allowed root, so its part must be full (`PartChains`). Blocks (realpath): call it once,
    at start."""
    return frozenset(
        parse_object_url(root).url if is_object_url(root) else os.path.realpath(root)
        for root in allowed_roots
    )


class PartStorage:
    """Parts on the local filesystem or an object store, by the location's form."""

    def __init__(
        self,
        local: CheckpointStorage | None = None,
        objects: CheckpointStorage | None = None,
        allowed_roots: Sequence[str] = (),
    ) -> None:
        """`allowed_roots`: the roots checkpoint locations were validated against; a chained
        part is read and written only strictly below one (its references resolve beside it)."""
        self.local: CheckpointStorage = local or LocalStorage(allowed_roots=allowed_roots)
        self.objects: CheckpointStorage = objects or ObjectPartStorage(allowed_roots=allowed_roots)

    def _backend(self, checkpoint_dir: str) -> CheckpointStorage:
        return self.objects if is_object_url(checkpoint_dir) else self.local

    def write_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        checkpoint_id: str,
        lines: Iterable[bytes],
        fence: WriteFence,
        chain: PartChain | None = None,
    ) -> PublishedPart:
        backend = self._backend(checkpoint_dir)
        if chain is None:  # a full part: every backend (and every test double) writes it
            return backend.write_part(checkpoint_dir, kind, instance, checkpoint_id, lines, fence)
        return backend.write_part(
            checkpoint_dir, kind, instance, checkpoint_id, lines, fence, chain
        )

    def read_part(
        self,
        checkpoint_dir: str,
        kind: str,
        instance: str,
        select: Callable[[dict[str, Any]], bool],
    ) -> tuple[StoredManifest, list[dict[str, Any]]]:
        return self._backend(checkpoint_dir).read_part(checkpoint_dir, kind, instance, select)
