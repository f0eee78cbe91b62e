"""Sphinx configuration of the docs site (scripts/docs builds it; tests/test_docs_site.py builds
it strictly, with -W --keep-going, so every warning below is a failing test).

Why Sphinx + MyST-Parser + autodoc + furo: Sphinx is the Python ecosystem's maintained site
generator and its autodoc writes the API reference from the docstrings, so the reference cannot
drift from the code; MyST-Parser lets the pages be Markdown, the language the README was written
in; furo is a maintained, readable theme. MkDocs 1.x has had no release since 2024-08 and
Material for MkDocs is in maintenance mode.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from sphinx.pycode import ModuleAnalyzer

if TYPE_CHECKING:
    from sphinx.application import Sphinx

project = "rollout-checkpoint"
author = "rollout-checkpoint contributors"
copyright = "rollout-checkpoint contributors"

extensions = ["myst_parser", "sphinx.ext.autodoc"]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generator"]

# Strictness: a reference to one of our own names that resolves nowhere (a renamed class in an
# annotation, a `{py:class}` role naming a module that moved) is a warning, and the build runs
# with -W. Third-party and standard-library names are exempt: the build is offline, so it has
# no intersphinx inventory to resolve them against, and listing them one by one would fail
# on every new annotation for a reason that is not a broken link.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!rollout_checkpoint\.).*"),
    (r"py:.*", r"rollout_checkpoint\.v1\..*"),
]
# Our own types that appear in a public signature but are not public themselves: they render
# as plain text. A new one fails the build until it is either documented (docs/api.md) or
# added here on purpose.
nitpick_ignore = [
    ("py:class", "rollout_checkpoint.server.core.clock.Clock"),
    ("py:class", "rollout_checkpoint.server.core.object_store.ObjectLocation"),
    ("py:class", "rollout_checkpoint.server.core.part_storage.CheckpointStorage"),
    ("py:class", "rollout_checkpoint.server.resources.participant.ResourcesParticipant"),
    ("py:class", "rollout_checkpoint.server.runtime.attempts.RetiredAttempts"),
    ("py:class", "rollout_checkpoint.server.runtime.control_plane.ControlPlane"),
    ("py:class", "rollout_checkpoint.server.runtime.state_machine.ControlSettings"),
    ("py:class", "rollout_checkpoint.server.runtime.telemetry.RuntimeObserver"),
    ("py:class", "rollout_checkpoint.server.runtime.worker_bridge.WorkerBridge"),
]

# A signature's builtin `bytes` is looked up among our names too, and two public dataclasses
# have a field called `bytes` (CheckpointOutcome, ParticipantSummary): Sphinx reports the
# ambiguity ("more than one target found") and links the builtin name to neither. Only that
# warning is silenced; a reference to a missing name still fails the build (nitpicky).
suppress_warnings = ["ref.python"]

# MyST: `[text](#target)` and `[text](page.md#heading)` resolve to heading anchors, so a page
# may link to a section of another; a link to a missing page or anchor is a warning.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the API page lists each public module's members from its __all__ (autodoc honours
# __all__ for automodule :members:, in __all__'s order with "bysource"), so a name added to
# __all__ appears on the page without editing it; a module without __all__ shows the public
# names it defines. undoc-members: the page shows the API as it is, a member without a
# docstring included (tests/test_docstrings.py is what requires the docstrings).
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

html_theme = "furo"
html_title = "rollout-checkpoint"
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False

# A checkpoint id or an episode key in a page must never look like a smart quote or a dash.
smartquotes = False


def _documented_modules() -> list[ModuleType]:
    """Every module docs/api.md documents, imported.

    Imported here, before autodoc reads any of them, on purpose: autodoc, documenting a class
    attribute, copies the annotations it finds in the source of each base class's module into
    that base's live `__annotations__` (sphinx 9, `_ensure_annotations_from_type_comments`).
    For a pydantic model that adds `__pydantic_extra__: 'Dict[str, Any] | None'` to `BaseModel`
    itself, and every pydantic model *defined afterwards* with extra="allow" then fails to
    build (fastapi's `BaseModelWithConfig`, imported by the resources server): the page would
    lose a module depending on the order of its sections. Imported first, every model is
    already built.
    """
    api_page = (Path(__file__).parent / "api.md").read_text()
    names = re.findall(r"^\.\. automodule:: (\S+)$", api_page, re.MULTILINE)
    return [importlib.import_module(name) for name in names]


_MODULES = _documented_modules()


def _reexported_values(module: ModuleType) -> dict[str, ModuleType]:
    """The names of `module.__all__` that are plain values (not classes, functions or
    modules) without a docstring in `module`'s own source (automodule documents those), each
    with the submodule that defines it (the one whose source holds its docstring), found by
    identity among the package's loaded submodules."""
    found: dict[str, ModuleType] = {}
    prefix = module.__name__ + "."
    own_docs = ModuleAnalyzer.for_module(module.__name__).find_attr_docs()
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value):
            continue
        if ("", name) in own_docs:
            continue
        definers = [
            sub
            for sub_name, sub in sorted(sys.modules.items())
            if sub_name.startswith(prefix) and getattr(sub, name, None) is value
        ]
        found[name] = definers[0] if definers else module
    return found


_VALUES = {module.__name__: _reexported_values(module) for module in _MODULES}


def _add_reexported_values(app: Sphinx, docname: str, source: list[str]) -> None:
    """automodule honours `__all__` for classes and functions, but documents a plain value
    (a constant) only when its docstring is in the documented module's own source, so a
    constant re-exported from a submodule (nemo_gym's `SERVERS`) would vanish from the page.
    An explicit `autodata` after its module's `automodule` puts it back."""
    if docname != "api":
        return

    def with_values(match: re.Match[str]) -> str:
        module = match.group(1)
        lines = [f"\n.. autodata:: {module}.{name}\n   :no-value:" for name in _VALUES[module]]
        return match.group(0) + "".join(lines)

    source[0] = re.sub(r"^\.\. automodule:: (\S+)$", with_values, source[0], flags=re.MULTILINE)


def _docstring_of_reexported_value(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """A re-exported constant's docstring, from the submodule that defines it (autodoc would
    show its type's docstring instead: `dict()`'s for a dict)."""
    module_name, _, value_name = name.rpartition(".")
    definer = _VALUES.get(module_name, {}).get(value_name)
    if what != "data" or definer is None:
        return
    docs = ModuleAnalyzer.for_module(definer.__name__).find_attr_docs()
    lines[:] = docs.get(("", value_name), [])


def setup(app: Sphinx) -> None:
    app.connect("source-read", _add_reexported_values)
    app.connect("autodoc-process-docstring", _docstring_of_reexported_value)
