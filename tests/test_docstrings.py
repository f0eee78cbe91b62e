"""Every public definition of the extension surface says its contract in a docstring.

The extension surface is what a user implements or calls to make a server a participant
(the session hooks, the Participant ABC and its context, install_checkpointing and its
settings, the checkpoint modes, the error types) and what a controller calls to drive one
(the ParticipantClient, ControlError, the fleet file model). A hook without a docstring is
one the user implements by guessing: what it may raise, whether it may be called twice,
in which order. This test walks those modules and fails on any public class, function,
method or property (no leading underscore, defined in that module) without a docstring.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

EXTENSION_SURFACE = (
    "rollout_checkpoint.server.runtime.participant",
    "rollout_checkpoint.server.runtime.install",
    "rollout_checkpoint.server.runtime.settings",
    "rollout_checkpoint.server.resources",
    "rollout_checkpoint.server.resources.mcp",
    "rollout_checkpoint.server.resources.middleware",
    "rollout_checkpoint.server.resources.participant",
    "rollout_checkpoint.server.resources.server",
    "rollout_checkpoint.server.nemo_gym.integration",
    "rollout_checkpoint.server.nemo_gym.hooks",
    "rollout_checkpoint.server.nemo_gym.servers",
    "rollout_checkpoint.server.episodic.episode_participant",
    "rollout_checkpoint.server.episodic.episode_steps",
    "rollout_checkpoint.server.model.participant",
    "rollout_checkpoint.server.core.episodes",
    "rollout_checkpoint.server.core.errors",
    "rollout_checkpoint.client.participant",
    "rollout_checkpoint.client.errors",
    "rollout_checkpoint.client.fleet.spec",
    "rollout_checkpoint.client.fleet.discovery",
)


def _public(name: str) -> bool:
    return not name.startswith("_")


def _defined_in(value: Any, module: ModuleType) -> bool:
    return getattr(value, "__module__", None) == module.__name__


def _own_docstring(value: Any) -> str | None:
    """The docstring written on this object itself (inspect.getdoc would inherit one from a
    base class, which for an override says the base's contract, not this one's)."""
    if isinstance(value, property):
        return value.__doc__
    doc = getattr(value, "__doc__", None)
    return doc if isinstance(doc, str) else None


def _undocumented(module: ModuleType) -> Iterator[str]:
    for name, value in vars(module).items():
        if not _public(name) or not _defined_in(value, module):
            continue
        if inspect.isfunction(value) and not _own_docstring(value):
            yield f"{module.__name__}.{name}"
        if inspect.isclass(value):
            yield from _undocumented_class(module, name, value)


def _undocumented_class(module: ModuleType, name: str, cls: type) -> Iterator[str]:
    if not _own_docstring(cls) or cls.__doc__ == _generated_doc(cls):
        yield f"{module.__name__}.{name}"
    for member_name, member in vars(cls).items():
        if not _public(member_name):
            continue
        function = member.__func__ if isinstance(member, staticmethod | classmethod) else member
        if isinstance(function, property):
            function = function.fget
        if not inspect.isfunction(function):
            continue
        if not _own_docstring(function) and not _overrides_documented(cls, member_name):
            yield f"{module.__name__}.{name}.{member_name}"


def _overrides_documented(cls: type, name: str) -> bool:
    """An override of a documented base method (a Participant's export, an enum's __str__)
    inherits the contract it implements; only new public names must say their own."""
    for base in cls.__mro__[1:]:
        inherited = vars(base).get(name)
        if inherited is not None and inspect.getdoc(inherited):
            return True
    return False


def _generated_doc(cls: type) -> str | None:
    """The signature docstring dataclasses and NamedTuple write for an undocumented class:
    it names the fields but says nothing of their meaning, so it does not count."""
    if "_fields" in vars(cls):  # typing.NamedTuple / collections.namedtuple
        return f"{cls.__name__}({', '.join(vars(cls)['_fields'])})"
    if "__dataclass_fields__" in vars(cls):
        return f"{cls.__name__}{inspect.signature(cls)}".replace(" -> None", "")
    return None


@pytest.mark.parametrize("module_name", EXTENSION_SURFACE)
def test_every_public_definition_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    missing = sorted(_undocumented(module))
    assert not missing, f"public definitions without a docstring: {missing}"


FIELD_DOCUMENTED = (
    ("rollout_checkpoint.server.resources.participant", "CheckpointMode"),
    ("rollout_checkpoint.server.resources.participant", "VerifyMode"),
    ("rollout_checkpoint.server.resources.server", "ResourcesServerConfig"),
    ("rollout_checkpoint.server.runtime.participant", "BlockerReason"),
    ("rollout_checkpoint.server.runtime.settings", "CheckpointSettings"),
    ("rollout_checkpoint.server.episodic.episode_steps", "StepMode"),
    ("rollout_checkpoint.server.episodic.episode_steps", "Phase"),
    ("rollout_checkpoint.client.fleet.spec", "FleetSpec"),
)
"""Classes whose every member or field is part of the contract: a mode a user picks, a
setting a user sets, a key of the fleet file. Each needs its own attribute docstring (the
string right after it), the form editors and `help()` readers of the source see."""


def _undocumented_fields(module_name: str, class_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    tree = ast.parse(inspect.getsource(module))
    (cls,) = (
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name
    )
    missing = []
    for statement, following in zip(cls.body, [*cls.body[1:], None], strict=True):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
        elif (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
        ):
            name = statement.targets[0].id
        else:
            continue
        if not _public(name) or name == "model_config":
            continue
        documented = (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        )
        if not documented:
            missing.append(f"{class_name}.{name}")
    return missing


@pytest.mark.parametrize(("module_name", "class_name"), FIELD_DOCUMENTED)
def test_every_member_and_field_of_the_contract_is_documented(
    module_name: str, class_name: str
) -> None:
    missing = _undocumented_fields(module_name, class_name)
    assert not missing, f"members or fields without a docstring: {missing}"
