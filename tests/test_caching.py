"""Cache versions follow the code: edit a module a task uses and its version changes."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
from flytekit.core.cache import VersionParameters

from flyscale.caching import SourcePolicy, module_closure, source_hash


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "acmepkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "task_mod.py").write_text("from acmepkg import helper\nfrom .sub import leaf\n\ndef fn():\n    return helper.x\n")
    (root / "helper.py").write_text("x = 1\n")
    (root / "unrelated.py").write_text("y = 2\n")
    (root / "sub").mkdir()
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "leaf.py").write_text("z = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.startswith("acmepkg")]:
        del sys.modules[name]


def _version(root) -> str:
    return source_hash(module_closure(["acmepkg.task_mod"], first_party=("acmepkg",)))


def test_closure_follows_absolute_and_relative_imports(pkg):
    mods = module_closure(["acmepkg.task_mod"], first_party=("acmepkg",))
    assert {"acmepkg.task_mod", "acmepkg.helper", "acmepkg.sub.leaf"} <= set(mods)
    assert "acmepkg.unrelated" not in mods


def test_version_changes_with_imported_code_only(pkg):
    before = _version(pkg)
    (pkg / "unrelated.py").write_text("y = 3\n")
    assert _version(pkg) == before
    (pkg / "sub" / "leaf.py").write_text("z = 4  # even a comment is a change\n")
    assert _version(pkg) != before


def test_task_version_changes_when_its_plugin_code_changes(tmp_path, monkeypatch):
    from flyscale import registry

    mod = tmp_path / "acme_cache_plugin.py"
    mod.write_text(textwrap.dedent("""
        class Tiny:
            options_type = None
            def build(self, options, info):
                raise NotImplementedError
        tiny = Tiny()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = importlib.import_module("acme_cache_plugin").tiny
    monkeypatch.setitem(registry.models._manual, "acme_tiny", plugin)
    from tasks.train import train_model

    params = VersionParameters(func=train_model.task_function)
    policy = SourcePolicy(("models", "strategies"))
    before = policy.get_version("", params)
    assert policy.get_version("", params) == before  # stable when nothing changed
    mod.write_text(mod.read_text() + "\n# retuned\n")
    assert policy.get_version("", params) != before
    del sys.modules["acme_cache_plugin"]


def test_register_task_version_includes_the_mlflow_store(monkeypatch):
    from flyscale import tracking
    from tasks.register import register_model

    p = SourcePolicy(("models",), extra=tracking.tracking_uri)
    params = VersionParameters(func=register_model.task_function)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://a:5000")
    a = p.get_version("", params)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://b:5000")
    assert p.get_version("", params) != a
