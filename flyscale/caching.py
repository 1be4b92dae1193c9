"""Cache versions derived from code, so nobody bumps a version string by hand.

A task's cache version is a hash of the source of the task's module, every first-party module
it imports (transitively), and the modules of every installed plugin of the kinds it uses.
Editing a comment in the training loop re-runs training; editing the README re-runs nothing.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from typing import Callable

from flytekit import Cache
from flytekit.core.cache import VersionParameters

FIRST_PARTY = ("flyscale", "plugins", "tasks", "workflows")


def _module_file(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec and spec.origin and spec.origin.endswith(".py") else None


def _imports(path: str, module: str) -> set[str]:
    """Module names imported by the file at `path` (absolute names; relative ones resolved)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def module_closure(roots: list[str], first_party: tuple[str, ...] = FIRST_PARTY) -> dict[str, str]:
    """{module: file} for `roots` and every first-party module they import, transitively."""
    seen: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        for imported in _imports(path, name):
            if imported.split(".")[0] in first_party or imported in roots:
                stack.append(imported)
    return seen


def source_hash(modules: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(modules):
        digest.update(name.encode())
        with open(modules[name], "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


class SourcePolicy:
    """flytekit CachePolicy: the task's code and its plugins' code make the version."""

    def __init__(self, plugin_kinds: tuple[str, ...] = (), extra: Callable[[], str] | None = None):
        self.plugin_kinds = plugin_kinds
        self.extra = extra  # anything outside the inputs that changes the result (e.g. the MLflow store)

    def get_version(self, salt: str, params: VersionParameters) -> str:
        from plugins import registry

        roots = [params.func.__module__]
        plugin_roots = [m for kind in self.plugin_kinds for m in registry.ALL[kind].source_modules()]
        # Plugin packages are first-party for this purpose: their own imports count too.
        packages = FIRST_PARTY + tuple({m.split(".")[0] for m in plugin_roots})
        modules = module_closure(roots + plugin_roots, packages)
        extra = self.extra() if self.extra else ""
        return f"{salt}{source_hash(modules)}{extra}"


def code_cache(*plugin_kinds: str, extra: Callable[[], str] | None = None) -> Cache:
    """`Cache` for a flyscale task that uses plugins of `plugin_kinds`."""
    return Cache(policies=SourcePolicy(tuple(plugin_kinds), extra))
