"""Name -> implementation registries, one per extension kind, filled from Python entry points.

Built-in plugins register exactly like third-party ones: through the entry-point groups
declared in pyproject.toml (``flyscale.datasets``, ``flyscale.models``, ...). A plugin that
fails to import is recorded with its package and error, and only breaks a lookup of that name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, Iterator, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PluginInfo:
    """Where a registered plugin came from, for `flyscale plugins` and error messages."""

    kind: str
    name: str
    value: str  # "module:attr"
    distribution: str  # the installed package that declared it
    error: str | None = None  # import error, if loading failed


class PluginLoadError(ImportError):
    """A plugin was found but its code could not be imported."""


class Registry(Generic[T]):
    """Plugins of one kind, keyed by name, loaded lazily from one entry-point group."""

    def __init__(self, kind: str):
        self.kind = kind
        self.group = f"flyscale.{kind}"
        self._loaded: dict[str, T] = {}
        self._errors: dict[str, str] = {}
        self._entry_points: dict[str, EntryPoint] | None = None
        self._manual: dict[str, T] = {}

    def _eps(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in entry_points(group=self.group)}
        return self._entry_points

    def register(self, name: str, plugin: T) -> T:
        """Register an object directly (tests, notebooks); entry points are the normal route."""
        self._manual[name] = plugin
        return plugin

    def names(self) -> list[str]:
        """Every registered name, whether or not it imports."""
        return sorted(set(self._eps()) | set(self._manual))

    def get(self, name: str) -> T:
        """The plugin called `name`; a clear error if it is unknown or broken."""
        if name in self._manual:
            return self._manual[name]
        if name in self._loaded:
            return self._loaded[name]
        ep = self._eps().get(name)
        if ep is None:
            raise ValueError(
                f"unknown {self.kind[:-1]} {name!r}; available: {', '.join(self.names()) or '(none)'}"
            )
        try:
            plugin = ep.load()
        except Exception as exc:  # any import-time failure belongs to the plugin, not to us
            dist = ep.dist.name if ep.dist else "?"
            self._errors[name] = f"{type(exc).__name__}: {exc}"
            raise PluginLoadError(
                f"{self.kind[:-1]} plugin {name!r} from package {dist!r} ({ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}. Other {self.kind}: "
                f"{', '.join(n for n in self.names() if n != name) or '(none)'}"
            ) from exc
        self._loaded[name] = plugin
        return plugin

    def info(self) -> Iterator[PluginInfo]:
        """Describe every plugin of this kind, trying to load each one."""
        for name in self.names():
            if name in self._manual:
                obj = self._manual[name]
                yield PluginInfo(self.kind, name, f"{type(obj).__module__}", "(registered in code)")
                continue
            ep = self._eps()[name]
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "?"
            error = None
            try:
                self.get(name)
            except PluginLoadError:
                error = self._errors[name]
            yield PluginInfo(self.kind, name, ep.value, dist, error)

    def source_modules(self) -> list[str]:
        """Module names that implement this kind's plugins (for cache versions)."""
        mods = {ep.value.split(":")[0] for ep in self._eps().values()}
        mods |= {type(p).__module__ if not callable(p) else getattr(p, "__module__", "") for p in self._manual.values()}
        return sorted(m for m in mods if m)


datasets: Registry[Any] = Registry("datasets")
models: Registry[Any] = Registry("models")
augmentations: Registry[Any] = Registry("augmentations")
strategies: Registry[Any] = Registry("strategies")
quantizers: Registry[Any] = Registry("quantizers")
gates: Registry[Any] = Registry("gates")

ALL: dict[str, Registry[Any]] = {
    r.kind: r for r in (datasets, models, augmentations, strategies, quantizers, gates)
}
