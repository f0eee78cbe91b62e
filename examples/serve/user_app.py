"""`serve MODULE:ATTRIBUTE`: a user's own server, served as the examples are.

MODULE is imported with the working directory first on `sys.path` (uvicorn's `--app-dir`
default; `serve` itself runs with `-P`, so only this import sees that directory). ATTRIBUTE, a
dotted path inside MODULE, names one of:

- a `ResourcesServer` subclass: built from the flags as the example resources servers are
  (`--instance`, `--session-secret`, `--mcp`), and it may run `--workers N`: each worker
  imports MODULE:ATTRIBUTE and builds its own copy;
- an app factory: a plain function called with the `CheckpointSettings` made from the flags
  (None with `--no-checkpoint`), returning a Starlette or FastAPI app on which it called
  `install_checkpointing` with exactly those settings. The announced `kind` is its
  participant's. One process only: the main process of `--workers N` must know the kind, and
  so where restored records go, before any worker builds an app.

Not an app or a server instance built at import: its checkpoint settings were fixed before
`serve` read its flags, so `--grpc-address`, `--token` or `--start-closed` would be silently
ignored, and a replacement meant to start closed would open at once and take requests before
its Restore. Every refusal is one line and exit 2, given before anything listens.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

from starlette.applications import Starlette

from rollout_checkpoint.server.core.extras import MissingExtra
from rollout_checkpoint.server.resources import ResourcesServer
from rollout_checkpoint.server.runtime.install import CheckpointRuntime
from rollout_checkpoint.server.runtime.settings import CheckpointSettings

from .arguments import EXIT_USAGE, fail
from .kinds import KINDS

SERVABLE = (
    "a ResourcesServer subclass, or a function taking the CheckpointSettings and returning "
    "the app it installed checkpointing on"
)
"""What ATTRIBUTE may name, as every refusal of a wrong one says."""

AppFactory = Callable[[CheckpointSettings | None], object]


def describe(error: BaseException) -> str:
    """An exception of the user's code as one line: its type, its message with the line breaks
    folded (pydantic's run over several), and where it was raised."""
    where = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith("<")  # importlib's own frames, frozen
    ]
    place = f" ({where[-1].filename}:{where[-1].lineno})" if where else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())}{place}"


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the user's code (a constructor, `build_app`, a factory): whatever it raises ends
    the process with one line naming it and exit 2, before anything listens. A missing extra
    (`--mcp` without the mcp extra) is the caller's to report, as for the examples."""
    try:
        yield
    except MissingExtra:
        raise
    except Exception as error:
        fail(EXIT_USAGE, f"{what} raised {describe(error)}")


@dataclass(frozen=True)
class UserApp:
    """What MODULE:ATTRIBUTE named, checked to be servable."""

    reference: str
    target: type[ResourcesServer] | AppFactory

    @property
    def server_class(self) -> type[ResourcesServer] | None:
        return self.target if isinstance(self.target, type) else None

    @property
    def is_factory(self) -> bool:
        return self.server_class is None

    @property
    def kind(self) -> str | None:
        """The kind before anything is built: a resources server's; a factory's is known only
        from the participant it installs (`served_kind`)."""
        return None if self.is_factory else "resources"

    @property
    def default_instance(self) -> str:
        """`--instance`'s default, MODULE.ATTRIBUTE: the same for a replacement started with
        the same command, so it finds its part of the checkpoint."""
        return self.reference.replace(":", ".")

    def from_factory(
        self, factory: AppFactory, checkpoint: CheckpointSettings | None
    ) -> tuple[Starlette, CheckpointRuntime | None]:
        """The factory's app and its runtime, refused when the flags would not apply to it."""
        with user_code(self.reference):
            app = factory(checkpoint)
        if not isinstance(app, Starlette):
            fail(
                EXIT_USAGE,
                f"{self.reference} returned {type(app).__name__}, not a Starlette or FastAPI app",
            )
        runtime = getattr(app.state, "checkpoint", None)
        if checkpoint is None:
            return app, None
        if not isinstance(runtime, CheckpointRuntime):
            fail(
                EXIT_USAGE,
                f"{self.reference} returned an app without checkpointing: call "
                "install_checkpointing(app, participant, settings) with the settings it is given",
            )
        if runtime.settings != checkpoint:
            fail(
                EXIT_USAGE,
                f"{self.reference} installed checkpointing with settings of its own: pass "
                "install_checkpointing the settings it is given, or serve's flags "
                "(--grpc-address, --token, --start-closed, ...) do not apply",
            )
        return app, runtime


def load(reference: str) -> UserApp:
    """Import MODULE and find ATTRIBUTE in it; exit 2 with one line when either is missing or
    ATTRIBUTE is nothing `serve` can run with its flags applied."""
    module_name, _, attribute = reference.partition(":")
    module = import_module(module_name)
    target: object = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            fail(
                EXIT_USAGE,
                f"{reference}: module {module_name} ({module.__file__}) has no attribute "
                f"{attribute}",
            )
        target = getattr(target, part)
    return UserApp(reference, servable(reference, target))


def import_module(name: str) -> ModuleType:
    directory = os.getcwd()
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and f"{name}.".startswith(f"{error.name}."):
            fail(EXIT_USAGE, f"no module named {name} in {directory} or the environment")
        fail(EXIT_USAGE, f"importing {name} raised {describe(error)}")
    except Exception as error:  # the module's own code failed (SyntaxError included)
        fail(EXIT_USAGE, f"importing {name} raised {describe(error)}")


def servable(reference: str, target: object) -> type[ResourcesServer] | AppFactory:
    if isinstance(target, type):
        if issubclass(target, ResourcesServer):
            return target
        refuse(reference, f"is the class {target.__name__}, not a ResourcesServer subclass")
    if isinstance(target, Starlette | ResourcesServer):
        refuse(
            reference,
            f"is a {type(target).__name__} built at import, with checkpoint settings fixed "
            "before serve read its flags",
        )
    if not callable(target):
        refuse(reference, f"is of type {type(target).__name__}")
    if inspect.iscoroutinefunction(target):
        refuse(reference, "is an async function (an ASGI app?), not a plain factory")
    if not takes_one_argument(target):
        refuse(reference, "cannot be called with one argument, the CheckpointSettings")
    factory: AppFactory = target
    return factory


def takes_one_argument(function: Callable[..., Any]) -> bool:
    try:
        inspect.signature(function).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): the call itself will tell
        return True
    return True


def refuse(reference: str, why: str) -> NoReturn:
    fail(EXIT_USAGE, f"{reference} {why}; serve runs {SERVABLE}")


def served_kind(
    server: str, user_app: UserApp | None, runtime: CheckpointRuntime | None = None
) -> str | None:
    """The kind of what `serve` runs: an example's from the table, a user's resources
    server's, a user's factory's from the participant its app installed (`runtime`: None
    before the app is built, or without checkpointing: then it is not known)."""
    if user_app is None:
        return KINDS[server]
    if user_app.kind is not None or runtime is None:
        return user_app.kind
    return runtime.control.participant.kind.value
