"""Name -> plugin registries, one per extension kind, filled from Python entry points.

Built-in plugins register exactly like third-party ones, through the entry-point groups in
pyproject.toml (`flyscale.datasets`, `flyscale.models`, ...); the core finds every plugin by
name here and imports none of them itself. A plugin is loaded once: a class is instantiated
with no arguments, and the object is checked against its kind's Protocol (flyscale/plugin/kinds.py)
before anyone uses it. A plugin that fails to import or does not fit is recorded with its
package and the reason, and only breaks a lookup of that name.

Config finds a plugin and parses its options through `flyscale.config.plugins.resolve`, which
returns a `Resolved`: the plugin and its options as the plugin's own dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint, EntryPoints, entry_points
from typing import Any, cast

from flyscale.plugin.kinds import (
    ALTERNATIVES,
    ARGUMENTS_WHEN,
    OPTIONAL_ATTRIBUTES,
    OPTIONAL_METHODS,
    PROTOCOLS,
    REQUIRED_WHEN,
    SIGNATURE_HINTS,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginInfo:
    """Where a registered plugin came from, for `flyscale plugins` and error messages."""

    kind: str
    name: str
    value: str  # "module:attr"
    distribution: str  # the installed package that declared it
    error: str | None = None  # why it cannot be used: an import error or a contract violation


class PluginError(ValueError):
    """A plugin exists but cannot be used: its code does not import, or it does not fit its kind."""


class PluginLoadError(PluginError):
    """A plugin was found but its code could not be imported."""


class PluginContractError(PluginError):
    """A plugin was imported but does not provide what its kind requires."""


@dataclass(frozen=True)
class Resolved:
    """A plugin chosen by config, with its options parsed into the plugin's own dataclass."""

    kind: str
    name: str
    plugin: Any
    options: Any  # an instance of plugin.options_type, or None when it takes none

    def attribute(self, name: str) -> Any:
        """An optional attribute of the plugin, or its kind's default when the plugin leaves it out."""
        return getattr(self.plugin, name, OPTIONAL_ATTRIBUTES[self.kind][name])

    def method(self, name: str) -> Any:
        """An optional method of the plugin (its kind's OPTIONAL_METHODS), or None when it has none."""
        return optional_method(self.kind, self.plugin, name)


def optional_method(kind: str, plugin: Any, name: str) -> Any:
    """A method a plugin of `kind` may leave out (its OPTIONAL_METHODS, or a Protocol method it may
    replace by its ALTERNATIVES), or None when `plugin` has none: the one reader of such methods,
    for code handed a plugin object rather than a config (a strategy passed to the trainer)."""
    if name not in OPTIONAL_METHODS.get(kind, {}) and name not in ALTERNATIVES.get(kind, {}):
        raise KeyError(f"{name!r} is not an optional method of {kind}")
    found = getattr(plugin, name, None)
    return found if callable(found) else None


def _singular(kind: str) -> str:
    return kind.removesuffix("s") if kind != "strategies" else "strategy"


def _required_methods(kind: str) -> dict[str, list[str]]:
    """{method: [argument names]} the kind's Protocol declares ("__call__" for the object itself)."""
    protocol = PROTOCOLS[kind]
    methods = {}
    for name, member in vars(protocol).items():
        if inspect.isfunction(member) and (not name.startswith("_") or name == "__call__"):
            methods[name] = list(inspect.signature(member).parameters)[1:]  # without self
    return methods


def contract_problems(kind: str, plugin: Any) -> list[str]:
    """What `plugin` lacks to be a `kind` plugin, in words; empty when it conforms."""
    problems = []
    optional = OPTIONAL_METHODS.get(kind, {})
    methods = {**_required_methods(kind), **optional}
    because = {}  # {method: the attribute that changed its arguments}
    for attribute, (method, params) in ARGUMENTS_WHEN.get(kind, {}).items():
        if getattr(plugin, attribute, False):
            methods[method], because[method] = params, f" (it sets {attribute} = True)"
    for method, params in methods.items():
        itself = method == "__call__"  # augmentations and strategies are called directly
        expected = f"({', '.join(params)})" if itself else f"{method}({', '.join(params)})"
        target = plugin if itself else getattr(plugin, method, None)
        if itself and method in optional and not callable(plugin):  # a strategy in the parallelize form
            target = None
        if target is None and method in optional:
            continue
        alternative = ALTERNATIVES.get(kind, {}).get(method)
        if target is None and alternative and getattr(plugin, alternative, None) is not None:
            continue
        if target is None:
            problems.append(f"has no method {expected}")
        elif not callable(target):
            problems.append(f"is not callable as {expected}" if itself else f"has a {method} that is not callable")
        else:
            try:
                inspect.signature(target).bind(*params)
            except TypeError:
                got = f"{'' if itself else method}{inspect.signature(target)}"
                hint = SIGNATURE_HINTS.get((kind, method))
                problems.append(f"has {got}, not {expected}{because.get(method, '')}" + (f": {hint}" if hint else ""))
            except ValueError:  # a builtin without a signature: trust it
                pass
    for attribute, method in REQUIRED_WHEN.get(kind, {}).items():
        if getattr(plugin, attribute, False) and getattr(plugin, method, None) is None:
            wanted = ", ".join(optional[method])
            problems.append(f"sets {attribute} = True but has no method {method}({wanted}) to read the data with")
    options_type = getattr(plugin, "options_type", None)
    if options_type is not None and not (isinstance(options_type, type) and dataclasses.is_dataclass(options_type)):
        problems.append(f"has options_type = {options_type!r}; expected a dataclass or None")
    return problems


class Registry:
    """Plugins of one kind, keyed by name, loaded lazily from one entry-point group."""

    def __init__(self, kind: str):
        self.kind = kind
        self.group = f"flyscale.{kind}"
        self._loaded: dict[str, Any] = {}
        self._errors: dict[str, PluginError] = {}
        self._reasons: dict[str, str] = {}  # the short form of each error, for `flyscale plugins`
        self._entry_points: dict[str, EntryPoint] | None = None
        self._manual: dict[str, Any] = {}

    def _eps(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in _installed_entry_points().select(group=self.group)}
        return self._entry_points

    def register(self, name: str, plugin: Any) -> Any:
        """Register an object directly (tests, notebooks); entry points are the normal route."""
        plugin = self._checked(name, plugin, "(registered in code)", f"{type(plugin).__module__}")
        self._manual[name] = plugin
        return plugin

    def unregister(self, name: str) -> None:
        """Forget a plugin registered in code."""
        self._manual.pop(name, None)

    def names(self) -> list[str]:
        """Every registered name, whether or not it can be used."""
        return sorted(set(self._eps()) | set(self._manual))

    def _others(self, name: str) -> str:
        return ", ".join(n for n in self.names() if n != name) or "(none)"

    def _checked(self, name: str, obj: Any, dist: str, value: str) -> Any:
        """Instantiate a class once, then hold the object against the kind's contract."""
        where = f"{_singular(self.kind)} plugin {name!r} from package {dist!r} ({value})"
        if inspect.isclass(obj):
            try:
                obj = obj()
            except TypeError as exc:
                raise PluginContractError(
                    f"{where} names the class {obj.__name__}, which cannot be built without arguments ({exc}); "
                    f"name an instance in the entry point, or give every __init__ parameter a default"
                ) from exc
        problems = contract_problems(self.kind, obj)
        if problems:
            raise PluginContractError(f"{where} does not fit the {self.kind} contract: it " + "; it ".join(problems))
        return obj

    def get(self, name: str) -> Any:
        """The plugin called `name`, loaded and checked; a clear error if it is unknown or broken."""
        if name in self._manual:
            return self._manual[name]
        if name in self._loaded:
            return self._loaded[name]
        if name in self._errors:
            raise self._errors[name]
        ep = self._eps().get(name)
        if ep is None:
            raise ValueError(
                f"unknown {_singular(self.kind)} {name!r}; available: {', '.join(self.names()) or '(none)'}"
            )
        dist = ep.dist.name if ep.dist else "?"
        try:
            obj = ep.load()
        except Exception as exc:  # any import-time failure belongs to the plugin, not to us
            error = PluginLoadError(
                f"{_singular(self.kind)} plugin {name!r} from package {dist!r} ({ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}. Other {self.kind}: {self._others(name)}"
            )
            self._errors[name], self._reasons[name] = error, f"{type(exc).__name__}: {exc}"
            raise error from exc
        try:
            plugin = self._checked(name, obj, dist, ep.value)
        except PluginContractError as exc:
            self._errors[name], self._reasons[name] = exc, str(exc)
            raise
        self._loaded[name] = plugin
        return plugin

    def info(self) -> Iterator[PluginInfo]:
        """Describe every plugin of this kind, loading and checking each one."""
        for name in self.names():
            if name in self._manual:
                obj = self._manual[name]
                yield PluginInfo(self.kind, name, f"{type(obj).__module__}", "(registered in code)")
                continue
            ep = self._eps()[name]
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "?"
            try:
                self.get(name)
            except PluginError:
                pass
            yield PluginInfo(self.kind, name, ep.value, dist, self._reasons.get(name))

    def source_modules(self) -> list[str]:
        """Module names that implement this kind's plugins (for cache versions)."""
        mods = {ep.value.split(":")[0] for ep in self._eps().values()}
        mods |= {type(p).__module__ if not callable(p) else getattr(p, "__module__", "") for p in self._manual.values()}
        return sorted(m for m in mods if m)


@functools.lru_cache(maxsize=1)
def _installed_entry_points() -> EntryPoints:
    """Every installed distribution's entry points, read once a process: each read walks every
    distribution's metadata (about 10 ms here), and the seven registries all ask. (Python 3.11
    gives them grouped, as SelectableGroups, which `select(group=...)` the same way.)"""
    return cast(EntryPoints, entry_points())


datasets = Registry("datasets")
models = Registry("models")
augmentations = Registry("augmentations")
strategies = Registry("strategies")
quantizers = Registry("quantizers")
gates = Registry("gates")
objectives = Registry("objectives")

ALL: dict[str, Registry] = {
    r.kind: r for r in (datasets, models, augmentations, strategies, quantizers, gates, objectives)
}
