"""Who is woken by which change: the control plane's two kinds of listeners.

Two changes happen at very different rates, so they wake different listeners:

* A data-plane change (`changed`): a request started or ended, a blocker appeared or went
  away. It happens twice per request, so it costs only what a waiter needs: the event a
  Prepare waits on is made only when someone waits for it (`change_event`), not once per
  call, and only the plain listeners are told.
* A control-state change (`state_changed`): state, admission, a seal, shutdown. The state
  machine signals it after each of its transitions, and it also wakes the state listeners
  (the health's readiness check). A participant's own `changed()` never alters the control
  state, so the readiness check is not run for each request (it cost a running sidecar
  about 1.5 µs per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class ChangeSignals:
    """The change event and the listeners of one control plane (see the module docstring)."""

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None
        self._listeners: list[Callable[[], None]] = []
        self._state_listeners: list[Callable[[], None]] = []

    def changed(self) -> None:
        """Wake every waiter: readiness, state or admission may have changed."""
        event, self._changed = self._changed, None
        if event is not None:
            event.set()
        if self._listeners:
            for listener in list(self._listeners):
                listener()

    def state_changed(self) -> None:
        """The control state may have changed: wake everyone `changed` wakes, and the state
        listeners too."""
        self.changed()
        for listener in list(self._state_listeners):
            listener()

    def change_event(self) -> asyncio.Event:
        """The event the next `changed()` sets."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change (`changed`), a data-plane request's included."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    def add_state_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change of the control state only (`state_changed`):
        state, admission, a seal, shutdown; never for a data-plane request."""
        self._state_listeners.append(listener)
