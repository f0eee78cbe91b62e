"""Run a command of this project in a process whose local checkpoint storage hangs, as on a
frozen filesystem (`fsfreeze`), which a test cannot do without root and a block device.

    python -m tests.frozen_storage FUNCTIONS MODULE [ARGS...]

FUNCTIONS names the `server.core.safe_files` functions that never return once called
(comma-separated): `opened` stalls every access of a controller to a local checkpoint root
(publication, `LATEST`, inspection), `write_all` a participant's part write. Each stall first
prints `frozen: <name>` to stderr, so a test waits for that line instead of sleeping; the
thread then blocks for good, as one stuck in the kernel would (nothing thaws it). MODULE is
run as `python -m MODULE ARGS...` would run it.
"""

from __future__ import annotations

import runpy
import sys
import threading
from typing import Any, NoReturn

from rollout_checkpoint.server.core import safe_files

FROZEN_LINE = "frozen: "


def _stall(name: str) -> Any:
    def stalled(*args: Any, **kwargs: Any) -> NoReturn:
        print(f"{FROZEN_LINE}{name}", file=sys.stderr, flush=True)
        threading.Event().wait()
        raise AssertionError("unreachable: nothing thaws a frozen filesystem")

    return stalled


def main() -> None:
    functions, module, *args = sys.argv[1:]
    for name in functions.split(","):
        getattr(safe_files, name)  # a typo fails here, not as a test that never stalls
        setattr(safe_files, name, _stall(name))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
