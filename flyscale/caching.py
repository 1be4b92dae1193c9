"""Cache versions derived from code, so nobody bumps a version string by hand.

A task's cache version is a hash of the source of the task's module, every first-party module
it imports (transitively), and the modules of every installed plugin of the kinds it uses.
First-party means flyscale itself, the task's own top-level package and each plugin's package.
Editing a comment in the training loop re-runs training; editing the README re-runs nothing.
A first-party import that cannot be found fails loudly: leaving it out would let its changes
replay stale results.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from typing import Callable

from flytekit import Cache
from flytekit.core.cache import VersionParameters

from flyscale import registry

CORE = "flyscale"


def _module_file(name: str) -> str | None:
    """The source file of module `name`, "" for a module without one, None if there is no such module."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin if spec.origin and spec.origin.endswith(".py") else ""


def _imports(path: str, module: str) -> tuple[set[str], set[str]]:
    """(modules the file at `path` imports, names that may be modules: the `x` of `from pkg import x`)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    required: set[str] = set()
    maybe: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            required.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            required.add(base)
            maybe.update(f"{base}.{alias.name}" for alias in node.names)
    return required, maybe


def module_closure(roots: list[str], first_party: tuple[str, ...], optional_roots: list[str] = ()) -> dict[str, str]:
    """{module: file} for `roots` and every first-party module they import, transitively.

    Raises if a first-party module that is imported cannot be found. `optional_roots` may be
    missing (an installed plugin whose module is gone breaks only a lookup of that plugin).
    """
    seen: dict[str, str] = {}
    stack = [(name, True, "the task") for name in roots] + [(name, False, "") for name in optional_roots]
    while stack:
        name, required, importer = stack.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            if required:
                raise ImportError(f"cache version: {importer} imports {name!r}, which cannot be found; "
                                  f"a task's version must cover all of its code")
            continue  # `from pkg import name` where name is not a module
        seen[name] = path
        if not path:
            continue
        required_names, maybe = _imports(path, name)
        for imported, needed in [(m, True) for m in required_names] + [(m, False) for m in maybe]:
            if imported.split(".")[0] in first_party:
                stack.append((imported, needed, name))
    return seen


def source_hash(modules: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(modules):
        digest.update(name.encode())
        if modules[name]:
            with open(modules[name], "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


class SourcePolicy:
    """flytekit CachePolicy: the task's code and its plugins' code make the version."""

    def __init__(self, plugin_kinds: tuple[str, ...] = (), extra: Callable[[], str] | None = None):
        self.plugin_kinds = plugin_kinds
        self.extra = extra  # anything outside the inputs that changes the result (e.g. the MLflow store)

    def get_version(self, salt: str, params: VersionParameters) -> str:
        task_module = params.func.__module__
        plugin_roots = [m for kind in self.plugin_kinds for m in registry.ALL[kind].source_modules()]
        # The task's own package and each plugin's package are first-party here: their imports count too.
        packages = {CORE, task_module.split(".")[0]} | {m.split(".")[0] for m in plugin_roots}
        modules = module_closure([task_module], tuple(sorted(packages)), optional_roots=plugin_roots)
        extra = self.extra() if self.extra else ""
        return f"{salt}{source_hash(modules)}{extra}"


def code_cache(*plugin_kinds: str, extra: Callable[[], str] | None = None) -> Cache:
    """`Cache` for a flyscale task that uses plugins of `plugin_kinds`."""
    return Cache(policies=SourcePolicy(tuple(plugin_kinds), extra))
