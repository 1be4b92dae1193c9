"""Cache versions derived from the facts a task's result depends on, so nobody bumps a version
string by hand and no change outside a task's inputs replays a stale result.

A task's cache version hashes the source of the task's module, every first-party module it
imports (transitively) and the modules of every installed plugin of the kinds it uses; the
container image; the installed versions of the libraries that compute; and facts the task
names itself (the training launcher, the MLflow store).
First-party means flyscale itself, the task's own top-level package and each plugin's package.
Editing a comment in the training loop re-runs training; editing the README re-runs nothing.
A first-party import that cannot be found fails loudly: leaving it out would let its changes
replay stale results.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
from collections.abc import Callable, Mapping
from typing import Any

from flytekit import Cache
from flytekit.core.cache import VersionParameters

from flyscale.flyte import memo
from flyscale.plugin import registry

CORE = "flyscale"


def _module_file(name: str, in_package: bool = False) -> str | None:
    """The source file of module `name`, "" for a module without one, None if there is no such module.

    `in_package`: `name` may be a module only if what holds it is a package (the `x` of `from a
    import x`). Finding `a.x` imports `a`, so for a plain module `a` that would run `a` and all it
    imports (for the pipeline strategy, torch's compiler: about a second) only to say no.
    """
    holder = name.rpartition(".")[0]
    if in_package and holder:
        spec = _spec(holder)
        if spec is None or spec.submodule_search_locations is None:
            return None
    spec = _spec(name)
    if spec is None:
        return None
    return spec.origin if spec.origin and spec.origin.endswith(".py") else ""


def _spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _imports(path: str, module: str) -> tuple[set[str], set[str]]:
    """(modules the file at `path` imports, names that may be modules: the `x` of `from pkg import x`)."""
    return _parsed_imports(path, module, os.stat(path).st_mtime_ns)


@functools.cache
def _parsed_imports(path: str, module: str, mtime_ns: int) -> tuple[set[str], set[str]]:
    # Every task's closure shares most files: parse each once per process (and again if edited),
    # and once per content on this machine (memo: the parse is most of a cached run's own time).
    source = open(path, "rb").read()
    statements = memo.remembered(
        "imports",
        memo.key(source),
        lambda: _import_statements(source, path),
        lambda found: json.dumps(found).encode(),
        _decode_statements,
    )
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    required: set[str] = set()
    maybe: set[str] = set()
    for level, base, names in statements:
        if level < 0:  # `import a, b.c`
            required.update(names)
            continue
        base = base or ""
        if level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - level + 1] + ([base] if base else []))
        required.add(base)
        maybe.update(f"{base}.{name}" for name in names)
    return required, maybe


def _decode_statements(data: bytes) -> list:
    found = json.loads(data)
    if not isinstance(found, list) or not all(isinstance(s, list) and len(s) == 3 for s in found):
        raise ValueError("not a list of import statements")
    return found


def _import_statements(source: bytes, path: str) -> list[tuple[int, str | None, list[str]]]:
    """Every import statement in `source`, anywhere in it, as (level, module, names): level -1 for
    `import names`, else `from <level dots><module> import names`."""
    found: list[tuple[int, str | None, list[str]]] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found.append((-1, None, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module, [alias.name for alias in node.names]))
    return found


def module_closure(
    roots: list[str], first_party: tuple[str, ...], optional_roots: tuple[str, ...] = ()
) -> dict[str, str]:
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
        path = _module_file(name, in_package=not required)
        if path is None:
            if required:
                raise ImportError(
                    f"cache version: {importer} imports {name!r}, which cannot be found; "
                    f"a task's version must cover all of its code"
                )
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


# The libraries whose version can change what a task computes. A new torch (or a CUDA build in
# place of a CPU one: the version says "+cpu" or "+cu126") is a different computation.
LIBRARIES = ("torch", "numpy", "pandas", "pyarrow", "scikit-learn", "scipy", "pandera", "flytekit")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str]:
    """{distribution: installed version} (read from metadata: nothing is imported)."""
    return {"python": platform.python_version(), **{name: _version(name) for name in names}}


# Once per process and library: every task asks (a lookup scans the installed distributions), and
# what is imported cannot change version meanwhile.
@functools.cache
def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def code_version(task_module: str, plugin_kinds: tuple[str, ...]) -> str:
    """A hash of the source of `task_module`, every first-party module it imports (transitively)
    and the installed plugins of `plugin_kinds`."""
    plugin_roots = [m for kind in plugin_kinds for m in registry.ALL[kind].source_modules()]
    # The task's own package and each plugin's package are first-party here: their imports count too.
    packages = {CORE, task_module.split(".")[0]} | {m.split(".")[0] for m in plugin_roots}
    modules = module_closure([task_module], tuple(sorted(packages)), optional_roots=tuple(plugin_roots))
    return source_hash(modules)


def _image(params: VersionParameters) -> str:
    image = params.container_image
    if image is None or isinstance(image, str):
        return image or ""
    return image.image_name()  # an ImageSpec: its name carries its content hash


class SourcePolicy:
    """flytekit CachePolicy: every fact outside a task's inputs that changes its result.

    The version hashes the task's code and its plugins' code, the container image, the
    versions of the libraries that compute, and the task's own `facts` (named callables, e.g.
    the launcher of a training task or the MLflow store a registering task writes to).
    """

    def __init__(
        self,
        plugin_kinds: tuple[str, ...] = (),
        facts: Mapping[str, Callable[[], str]] | None = None,
        libraries: tuple[str, ...] = LIBRARIES,
    ):
        self.plugin_kinds = plugin_kinds
        self.facts = dict(facts or {})
        self.libraries = libraries

    def describe(self, params: VersionParameters) -> dict[str, Any]:
        """The facts the version is made of, by name (what a person reads to see why a task re-ran)."""
        return {
            "code": code_version(params.func.__module__, self.plugin_kinds),
            "image": _image(params),
            "libraries": library_versions(self.libraries),
            **{name: fact() for name, fact in sorted(self.facts.items())},
        }

    def get_version(self, salt: str, params: VersionParameters) -> str:
        facts = json.dumps(self.describe(params), sort_keys=True)
        return salt + hashlib.sha256(facts.encode()).hexdigest()


def code_cache(
    *plugin_kinds: str,
    facts: Mapping[str, Callable[[], str]] | None = None,
    libraries: tuple[str, ...] = LIBRARIES,
    ignored_inputs: tuple[str, ...] = (),
) -> Cache:
    """`Cache` for a flyscale task that uses plugins of `plugin_kinds` (see SourcePolicy)."""
    return Cache(policies=SourcePolicy(tuple(plugin_kinds), facts, libraries), ignored_inputs=ignored_inputs)
