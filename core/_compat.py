"""Deprecated import paths of modules that moved in the 0.2 layout (issue 26), kept for one release.

``import rlx.checkpoint`` (or ``from rlx import builtin``) still works: it is the module at its new home,
with a :class:`DeprecationWarning` naming that home. A table of names, not imports: nothing in rlx uses
these paths, and the kernel does not depend on the plugins they point to.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "rlx.lora": "rlx.plugins.modeling.lora",
    "rlx.weight_sync": "rlx.plugins.launchers.weight_sync",
    "rlx.testing": "rlx.plugins.testing",
    "rlx.reward_modeling": "rlx.plugins.reward_modeling.trainer",
    "rlx.rm_config": "rlx.plugins.reward_modeling.config",
    "rlx.cli.rm": "rlx.plugins.reward_modeling.command",
    "rlx.provenance": "rlx.plugins.provenance.record",
    "rlx.cli.replay": "rlx.plugins.provenance.command",
    "rlx.checkpoint": "rlx.run.checkpoint",
    "rlx.data": "rlx.run.data",
    "rlx.models": "rlx.run.models",
    "rlx.evaluation": "rlx.run.evaluation",
    "rlx.flops": "rlx.run.metrics",
    "rlx.run_files": "rlx.run.files",
    "rlx.reward_runner": "rlx.run.rewards",
    "rlx.workers": "rlx.run.reward_worker",
    "rlx.answers": "rlx.run.answers",
    "rlx.datasets": "rlx.plugins.tasks.datasets",
    "rlx.builtin": "rlx.plugins.tasks.builtin",
    "rlx.training": "rlx.step",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and hands back the module at its new name."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in the next release).",
                      DeprecationWarning, stacklevel=4)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed under its new name already."""


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def moved_attributes(module: str, table: dict[str, str]) -> Any:
    """A module ``__getattr__`` for names that moved out of ``module`` (name -> the module that holds it now, or
    ``"module:new_name"`` when it was renamed): the old ``from module import name`` still works, with a
    DeprecationWarning naming the new home."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new = table[name].partition(":")
        warnings.warn(f"{module}.{name} moved to {home}.{new or name}; import it from there (the old path goes in "
                      "the next release).", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new or name)

    return __getattr__
