"""The plugin manager: finds plugins through the ``rlx`` entry-point group and indexes their components.

Rules (see docs/architecture.md):
- rlx's own plugins are registered through the same entry-point group as third-party ones.
- A plugin that fails to import is recorded and shown as failed; everything else keeps working.
  ``RLX_STRICT_PLUGINS=1`` makes such a failure fatal.
- ``RLX_DISABLE_PLUGINS=a,b`` skips the named entry points (or every plugin of the named
  distributions).
- Two components of the same kind and name are an error that names both distributions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from rlx import hookspecs
from rlx.components import KINDS, Component
from rlx.errors import UserError, describe_exception, did_you_mean

ENTRY_POINT_GROUP = "rlx"


@dataclass
class PluginRecord:
    """One entry point of the ``rlx`` group and what became of it."""

    name: str
    distribution: str
    version: str
    status: str  # "ok", "failed" or "disabled"
    error: str = ""
    hooks: list[str] = field(default_factory=list)


class PluginManager:
    """A typed facade over :class:`pluggy.PluginManager`: one method per question the core asks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self._components: dict[tuple[str, str], Component] | None = None
        self._origin: dict[int, tuple[str, str, str]] = {}

    # -- registration -------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None, distribution: str = "", version: str = "") -> None:
        """Register a plugin object or module directly (tests and embedding use this)."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            self.pm.unregister(name=name)
            raise
        self._origin[id(plugin)] = (name, distribution or name, version)
        self.plugins.append(PluginRecord(name, distribution or name, version, "ok",
                                         hooks=self._hook_names(plugin)))
        self._components = None

    def load_entry_points(self, strict: bool | None = None, disabled: Iterable[str] | None = None) -> None:
        """Load every plugin of the ``rlx`` entry-point group, one at a time."""
        strict = _env_flag("RLX_STRICT_PLUGINS") if strict is None else strict
        if disabled is None:
            disabled = [d.strip() for d in os.environ.get("RLX_DISABLE_PLUGINS", "").split(",") if d.strip()]
        off = set(disabled)
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist, ver = _dist_of(ep)
            if any(p.name == ep.name for p in self.plugins):
                continue
            if ep.name in off or dist in off:
                self.plugins.append(PluginRecord(ep.name, dist, ver, "disabled"))
                continue
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
                self.pm.check_pending()
            except Exception as exc:
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                if strict:
                    raise UserError(
                        f"Plugin {ep.name!r} from distribution {dist} {ver} failed to load: {exc}",
                        "Fix or uninstall that plugin, or unset RLX_STRICT_PLUGINS to skip failing plugins.",
                    ) from exc
                self.plugins.append(PluginRecord(ep.name, dist, ver, "failed",
                                                 error=describe_exception(exc)))
                continue
            self._origin[id(plugin)] = (ep.name, dist, ver)
            self.plugins.append(PluginRecord(ep.name, dist, ver, "ok", hooks=self._hook_names(plugin)))
        self._components = None

    def _hook_names(self, plugin: Any) -> list[str]:
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])

    # -- components ---------------------------------------------------------------------------
    def components(self) -> dict[tuple[str, str], Component]:
        """Every registered component, keyed by (kind, name)."""
        if self._components is not None:
            return self._components
        found: dict[tuple[str, str], Component] = {}
        collected: list[Component] = []
        for hook_name, kind in hookspecs.REGISTRATION_HOOKS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                origin = self._origin.get(id(impl.plugin), (impl.plugin_name, impl.plugin_name, ""))
                try:
                    records = list(impl.function() or [])
                except Exception as exc:  # a broken registration hook is a broken plugin
                    self._mark_failed(origin[0], exc)
                    continue
                for rec in records:
                    if not isinstance(rec, Component) or rec.kind != kind:
                        self._mark_failed(origin[0], TypeError(
                            f"{hook_name} must return Component records of kind {kind!r}; got {rec!r}"))
                        continue
                    collected.append(rec.with_origin(*origin))
        # A plugin that is broken in any way contributes nothing, not even its valid records.
        failed = {p.name for p in self.plugins if p.status == "failed"}
        for rec in collected:
            if rec.plugin in failed:
                continue
            key = (rec.kind, rec.name)
            if key in found:
                other = found[key]
                raise UserError(
                    f"Two plugins provide a {rec.kind} named {rec.name!r}: "
                    f"{other.plugin!r} from distribution {other.distribution} {other.version} and "
                    f"{rec.plugin!r} from distribution {rec.distribution} {rec.version}.",
                    "Uninstall one of them, or turn one off with RLX_DISABLE_PLUGINS=<entry point name>.",
                )
            found[key] = rec
        self._components = dict(sorted(found.items()))
        return self._components

    def _mark_failed(self, plugin_name: str, exc: BaseException) -> None:
        if _env_flag("RLX_STRICT_PLUGINS"):
            raise UserError(f"Plugin {plugin_name!r} is broken: {exc}")
        for rec in self.plugins:
            if rec.name == plugin_name:
                rec.status, rec.error = "failed", describe_exception(exc)

    def names(self, kind: str) -> list[str]:
        return [name for (k, name) in self.components() if k == kind]

    def get(self, kind: str, name: str) -> Component:
        """The component of this kind and name, or a :class:`UserError` listing the valid names."""
        if kind not in KINDS:
            raise ValueError(f"unknown component kind {kind!r}")
        comp = self.components().get((kind, name))
        if comp is not None:
            return comp
        valid = self.names(kind)
        failed = [p for p in self.plugins if p.status == "failed"]
        hint = "Run `rlx plugins list` to see every installed plugin."
        if failed:
            hint += " Some plugins failed to load: " + ", ".join(p.name for p in failed) + "."
        raise UserError(
            f"No {kind} named {name!r}.{did_you_mean(name, valid)} "
            f"Valid {kind}s: {', '.join(valid) or '(none installed)'}.",
            hint,
        )

    def find(self, name: str) -> list[Component]:
        """Every component with this name, of any kind."""
        return [c for (_, n), c in self.components().items() if n == name]

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def add_cli_commands(self, app: Any) -> None:
        self.pm.hook.rlx_cli_commands(app=app)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", ""
    return dist.metadata["Name"] or "?", dist.version or ""


_DEFAULT: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, loaded from entry points on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        pm = PluginManager()
        pm.load_entry_points()
        _DEFAULT = pm
    return _DEFAULT


def reset_plugin_manager(pm: PluginManager | None = None) -> None:
    """Replace (or forget) the process-wide plugin manager; tests use this."""
    global _DEFAULT
    _DEFAULT = pm
