"""The plugin manager: finds plugins through the ``rlx`` entry-point group and indexes their components.

Rules (see docs/architecture.md):
- rlx's own plugins are registered through the same entry-point group as third-party ones.
- A plugin that fails to import is recorded and shown as failed; everything else keeps working.
  ``RLX_STRICT_PLUGINS=1`` makes such a failure fatal.
- ``RLX_DISABLE_PLUGINS=a,b`` skips the named entry points (or every plugin of the named
  distributions), or turns off the components of that name as ``rlx plugins list`` shows them
  (``arith``); a name that matches none of these is reported on stderr with the valid names.
- Two components of the same kind and name, or two distributions with the same entry-point name, are
  an error that names both distributions: a plugin can never silently replace another.
- A plugin whose ``rlx_cli_commands`` hook fails is recorded as failed; the CLI keeps working.
- Faults of a plugin while a run is built or running (:meth:`PluginManager.build`,
  :meth:`PluginManager.call_lifecycle`) become a :class:`UserError` naming the plugin and its distribution.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict
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
        self._clashes: list[str] = []  # entry-point names used by two distributions
        # RLX_DISABLE_PLUGINS names that are neither an entry point nor a distribution: component names.
        self._off_components: set[str] = set()
        self.disabled_components: list[Component] = []

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
        found = sorted(((ep, *_dist_of(ep)) for ep in entry_points(group=ENTRY_POINT_GROUP)),
                       key=lambda e: (e[0].name, e[1]))
        self._off_components = off - {ep.name for ep, _, _ in found} - {dist for _, dist, _ in found}
        by_name: dict[str, list[tuple[EntryPoint, str, str]]] = defaultdict(list)
        for ep, dist, ver in found:
            if any(p.name == ep.name for p in self.plugins):
                continue
            if ep.name in off or dist in off:
                self.plugins.append(PluginRecord(ep.name, dist, ver, "disabled"))
                continue
            by_name[ep.name].append((ep, dist, ver))
        for name, eps in by_name.items():
            if len(eps) > 1:
                self._clash(name, eps, strict)
                continue
            ep, dist, ver = eps[0]
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
        if self._off_components:
            # Which names are components is known once the plugins are loaded; a clash is reported again,
            # as an error, by whatever asks for a component.
            with contextlib.suppress(UserError):
                self.components()

    def _clash(self, name: str, eps: list[tuple[EntryPoint, str, str]], strict: bool) -> None:
        """Several distributions register the entry point ``name``: none is loaded, since which one
        would win depends on the order of sys.path. Asking for components then fails (see :meth:`components`)."""
        dists = " and ".join(f"{dist} {ver}" for _, dist, ver in eps)
        message = f"The rlx plugin entry point {name!r} is registered by several distributions: {dists}."
        if strict:
            raise UserError(message, _CLASH_HINT)
        self._clashes.append(message)
        for _, dist, ver in eps:
            self.plugins.append(PluginRecord(name, dist, ver, "failed", error=message))

    def _hook_names(self, plugin: Any) -> list[str]:
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])

    # -- components ---------------------------------------------------------------------------
    def components(self) -> dict[tuple[str, str], Component]:
        """Every registered component, keyed by (kind, name)."""
        if self._components is not None:
            return self._components
        if self._clashes:
            raise UserError(" ".join(self._clashes), _CLASH_HINT)
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
        self.disabled_components = [c for c in found.values() if c.name in self._off_components]
        if self._off_components:
            _warn_unmatched(self._off_components - {c.name for c in self.disabled_components},
                            [(p.name, p.distribution) for p in self.plugins], sorted({n for _, n in found}))
            self._off_components &= {c.name for c in self.disabled_components}  # warned about once
        found = {k: c for k, c in found.items() if c not in self.disabled_components}
        self._components = dict(sorted(found.items()))
        return self._components

    def _mark_failed(self, plugin_name: str, exc: BaseException, where: str = "") -> None:
        if _env_flag("RLX_STRICT_PLUGINS"):
            raise UserError(f"Plugin {plugin_name!r} is broken{' in ' + where if where else ''}: {exc}")
        for rec in self.plugins:
            if rec.name == plugin_name:
                rec.status = "failed"
                rec.error = f"{where}: {describe_exception(exc)}" if where else describe_exception(exc)
        self._components = None  # its components are gone

    def names(self, kind: str) -> list[str]:
        return [name for (k, name) in self.components() if k == kind]

    def get(self, kind: str, name: str) -> Component:
        """The component of this kind and name, or a :class:`UserError` listing the valid names."""
        if kind not in KINDS:
            raise ValueError(f"unknown component kind {kind!r}")
        comp = self.components().get((kind, name))
        if comp is not None:
            return comp
        if any(c.kind == kind and c.name == name for c in self.disabled_components):
            raise UserError(f"The {kind} {name!r} is turned off: RLX_DISABLE_PLUGINS names it "
                            f"({os.environ.get('RLX_DISABLE_PLUGINS', '')!r}).",
                            f"Remove {name} from RLX_DISABLE_PLUGINS to use it.")
        valid = self.names(kind)
        failed = [p for p in self.plugins if p.status == "failed"]
        hint = "Run `rlx plugins list` to see every installed plugin."
        message = f"No {kind} named {name!r}.{did_you_mean(name, valid)} " \
                  f"Valid {kind}s: {', '.join(valid) or '(none installed)'}."
        if failed:
            hint += " Some plugins failed to load: " + ", ".join(p.name for p in failed) + "."
            # In the message too (a config problem shows only the message): the plugin the user installed for
            # this name is usually the one that failed, and is then first.
            failed.sort(key=lambda p: p.name != name)
            message += " Plugins that failed to load (one may provide it): " + "; ".join(
                f"{p.name} ({p.distribution} {p.version}: {((p.error or '').splitlines() or ['?'])[0]})"
                for p in failed) + "."
        raise UserError(message, hint)

    def find(self, name: str) -> list[Component]:
        """Every component with this name, of any kind."""
        return [c for (_, n), c in self.components().items() if n == name]

    def build(self, kind: str, name: str, options: Any, ctx: Any) -> Any:
        """Build a component: ``factory(options, ctx)``. A factory that cannot be imported or that raises is
        a :class:`UserError` naming the component, its plugin and distribution (a ``UserError`` the factory
        raises itself already says what to fix and passes through)."""
        comp = self.get(kind, name)
        what = describe_component(comp)
        try:
            factory = comp.load_factory()
        except Exception as exc:
            raise UserError(f"Cannot import the factory {comp.factory!r} of {what}: {describe_exception(exc)}",
                            "Reinstall or update that plugin, or report the fault to its authors.") from exc
        return call_factory(factory, options, ctx, what)

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def call_lifecycle(self, hook_name: str, **kwargs: Any) -> None:
        """Call a lifecycle hook (``rlx_on_step_end``, ...) one plugin at a time, in pluggy's order.

        A plugin that raises stops the run with a :class:`UserError` naming the plugin, its distribution,
        the hook and the step, instead of a traceback from inside pluggy.
        """
        if hook_name not in hookspecs.LIFECYCLE_HOOKS:
            raise ValueError(f"{hook_name!r} is not a lifecycle hook: {', '.join(hookspecs.LIFECYCLE_HOOKS)}")
        for impl, call in self._one_by_one(hook_name):
            try:
                call(**kwargs)
            except Exception as exc:
                name, dist, ver = self._origin.get(id(impl.plugin), (impl.plugin_name, impl.plugin_name, ""))
                at = f" at step {kwargs['step']}" if "step" in kwargs else ""
                raise UserError(f"Plugin {name!r} (distribution {dist} {ver}) failed in {hook_name}{at}: "
                                f"{describe_exception(exc)}",
                                f"Fix or update that plugin, or turn it off with RLX_DISABLE_PLUGINS={name}."
                                ) from exc

    def add_cli_commands(self, app: Any) -> None:
        """Let every plugin add its commands to ``app``. A plugin whose hook raises, or adds a command that
        typer cannot build, is recorded as failed and its additions are taken back: one broken plugin
        must not break ``rlx --help`` or any other command."""
        import typer.main

        for impl, call in self._one_by_one("rlx_cli_commands"):
            commands, groups = len(app.registered_commands), len(app.registered_groups)
            try:
                call(app=app)
                typer.main.get_command(app)
            except Exception as exc:
                del app.registered_commands[commands:]
                del app.registered_groups[groups:]
                self._mark_failed(impl.plugin_name, exc, where="rlx_cli_commands")

    def _one_by_one(self, hook_name: str) -> list[tuple[Any, Any]]:
        """Each implementation of a hook with a caller of just that one, in the order pluggy calls them."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        return [(impl, self.pm.subset_hook_caller(hook_name, [o.plugin for o in impls if o is not impl]))
                for impl in reversed(impls)]


_CLASH_HINT = ("Uninstall one of them, or turn one off with RLX_DISABLE_PLUGINS=<distribution name> "
               "(the entry point name would turn off both).")


def _warn_unmatched(unknown: set[str], plugins: list[tuple[str, str]], components: list[str]) -> None:
    """A name in RLX_DISABLE_PLUGINS that turns nothing off is most likely a typo: say so on stderr."""
    names = sorted({name for name, _ in plugins})
    dists = sorted({dist for _, dist in plugins})
    for name in sorted(unknown):
        print(f"Warning: RLX_DISABLE_PLUGINS names {name!r}, which is neither a component, an rlx plugin entry "
              f"point nor a distribution providing one, so it turns nothing off."
              f"{did_you_mean(name, components + names + dists)} Components: {', '.join(components)}. "
              f"Entry points: {', '.join(names)}. Distributions: {', '.join(dists)}.", file=sys.stderr)


def describe_component(comp: Component) -> str:
    """``kind 'name' (plugin P, distribution D V)``, for messages about a component."""
    return f"{comp.kind} {comp.name!r} (plugin {comp.plugin}, distribution {comp.distribution} {comp.version})"


@dataclass(frozen=True)
class Requirement:
    """An optional package a component cannot work without.

    ``module`` is looked up with :func:`importlib.util.find_spec` (nothing but its parent packages is
    imported); ``package`` is its name for pip; ``install`` says how to install it. ``unless`` names an
    option of the component that, when set (not None), makes the package unnecessary (sglang's
    ``server_url``: a running server instead of an engine in the process); ``when`` (option, value) limits
    the need to that value of an option (the math reward's ``backend=math_verify``).
    """

    module: str
    package: str
    install: str
    unless: str = ""
    when: tuple[str, Any] | None = None


def requirements(comp: Component) -> tuple[Requirement, ...]:
    """The optional packages ``comp`` needs, as it declares them: ``Component(..., extra={"requires":
    [Requirement(...), ...]})`` (rlx's own components declare theirs the same way)."""
    return tuple(comp.extra.get("requires") or ())


def missing_requirements(comp: Component, options: Any = None) -> list[Requirement]:
    """The requirements of ``comp`` (with its validated ``options``) that are not installed."""
    import importlib.util

    missing = []
    for req in requirements(comp):
        if req.unless and getattr(options, req.unless, None) is not None:
            continue
        if req.when is not None and getattr(options, req.when[0], None) != req.when[1]:
            continue
        try:
            found = importlib.util.find_spec(req.module) is not None
        except Exception:  # a parent package that fails to import is as good as missing
            found = False
        if not found:
            missing.append(req)
    return missing


def call_factory(factory: Any, options: Any, ctx: Any, what: str) -> Any:
    """``factory(options, ctx)``; a factory that raises is a :class:`UserError` naming ``what`` (a
    ``UserError`` the factory raises itself already says what to fix and passes through)."""
    try:
        return factory(options, ctx)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"Building {what} failed: {describe_exception(exc)}",
                        "If the message is about your model, data or options, fix them; otherwise report "
                        "it to the plugin's authors.") from exc


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
