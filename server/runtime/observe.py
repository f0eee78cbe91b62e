"""The observation hooks of the control plane: a protocol-sized base that does nothing.

The control plane and the sidecar call a `ControlObserver` at a few points and know nothing
of Prometheus or OpenTelemetry:

* the sidecar wraps every control RPC in `operation(name, metadata)` and tells it the
  checkpoint id and the refusal reason, if any;
* the control plane wraps its phases in `phase(name)` (export, write, read, install), reports
  the end of a prepare's wait, the drain time, what a commit wrote and a restore read, and
  lease expiries; the data plane's refusals arrive through `data_refused`.

`ControlObserver` itself does nothing (a control plane built without one, as in unit tests).
`telemetry.RuntimeObserver` is what `install_checkpointing` gives every runtime: Prometheus
metrics in its own registry, OpenTelemetry spans (when available) and structured log lines.
This module imports neither, so neither does the control plane.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

Metadata = Iterable[tuple[str, Any]] | None


class Operation:
    """One observed control RPC; use as a context manager around the handler."""

    def __enter__(self) -> Operation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def checkpoint(self, checkpoint_id: str) -> None:
        """The request's checkpoint id (logs and traces; never a metric label)."""

    def refused(self, reason: str) -> None:
        """The call ends with this ErrorInfo reason."""


class ControlObserver:
    """Hooks called by the control plane and the sidecar; this base does nothing."""

    def attach(self, control: Any) -> None:
        """Called once by the control plane it observes."""

    def operation(self, method: str, metadata: Metadata = None) -> Operation:
        return Operation()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def prepare_ended(self, state: str) -> None:
        """A Prepare stream's wait ended in `state` (PREPARING: its deadline passed)."""

    def drained(self, seconds: float) -> None:
        """Admission closed -> ready took `seconds`."""

    def committed(self, records: int, size: int) -> None: ...

    def restored(self, records: int, size: int) -> None: ...

    def lease_expired(self, checkpoint_id: str) -> None: ...

    def data_refused(self, code: str) -> None: ...

    def unauthenticated(self, method: str) -> None:
        """A control call without the right token was refused (TOKEN_INVALID)."""
