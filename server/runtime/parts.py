"""What every part of the control plane sees of it: the participant, the clock, the observer.

The parts (the Prepare stream, the commit and restore jobs) are given the control plane — or
its state machine — through protocols built on `ControlParts`, so each part states exactly
what it uses and none imports the module that wires them together (no import cycle, and a
part can be driven by a stand-in in a test).
"""

from __future__ import annotations

from typing import Protocol

from rollout_checkpoint.server.core.clock import Clock
from rollout_checkpoint.server.runtime.observe import ControlObserver
from rollout_checkpoint.server.runtime.participant import Participant


class ControlParts(Protocol):
    @property
    def participant(self) -> Participant: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def observer(self) -> ControlObserver: ...
