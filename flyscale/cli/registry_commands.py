"""The commands about registered versions: move the alias by hand (`rollback`, `promote`), serve a
version and measure it (`loadtest`), write a batching server's repository for it (`repository`)
and write it in Hugging Face's format (`huggingface`)."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_move(args: argparse.Namespace) -> int:
    """Move the alias to a version (rollback or promote), recording who and why."""
    import getpass

    from mlflow import MlflowClient

    from flyscale.tracking import promotion
    from flyscale.tracking import store as mlflow_store

    action = "rollback" if args.command == "rollback" else "promote"
    version = args.to if action == "rollback" else args.version
    who = args.who or os.environ.get("USER") or getpass.getuser()
    uri = mlflow_store.tracking_uri()
    print(f"tracking store: {mlflow_store.shown(uri)}", file=sys.stderr)
    missing = mlflow_store.missing_local_store(uri)
    if missing:  # opening it would create an empty store, in which nothing is registered
        print(f"flyscale {args.command}: {missing}", file=sys.stderr)
        return 2
    try:
        note = promotion.move_alias(MlflowClient(uri), args.model, args.alias, version, action, who, args.reason)
    except ValueError as exc:
        print(f"flyscale {args.command}: {exc}", file=sys.stderr)
        return 2
    print(note)
    return 0


def _served_version(args: argparse.Namespace):
    """The registered version --model/--version (or --alias) names, downloaded: a
    flyscale.serving.compare_servers.Target. ValueError (or MlflowException) when there is none."""
    import tempfile
    from pathlib import Path

    from mlflow import MlflowClient

    from flyscale.serving import compare_servers
    from flyscale.tracking.store import missing_local_store, quiet_artifacts, tracking_uri

    uri = tracking_uri()
    missing = missing_local_store(uri)
    if missing:
        raise ValueError(missing)
    version = str(args.version or MlflowClient(uri).get_model_version_by_alias(args.model, args.alias).version)
    folder = Path(tempfile.mkdtemp(prefix=f"flyscale-{args.command}-"))
    with quiet_artifacts():  # a progress bar per file would bury the command's one line
        return compare_servers.target(f"models:/{args.model}/{version}", args.model, version, folder)


def cmd_loadtest(args: argparse.Namespace) -> int:
    """Serve a registered version on loopback in each setup and measure it under load."""
    from pathlib import Path

    from mlflow.exceptions import MlflowException

    from flyscale.serving import compare_servers, servers
    from flyscale.serving.repository import Batching

    try:
        t = _served_version(args)
        setups = [s.strip() for s in args.setups.split(",") if s.strip()]
        levels = [int(c) for c in args.levels.split(",")]
        batching = Batching(args.max_batch_size, args.max_delay_ms)
        reports = compare_servers.run(t, setups, levels, args.requests, batching, Path(args.envs).expanduser())
    except (MlflowException, ValueError, servers.ServerError) as exc:
        print(f"flyscale loadtest: {exc}", file=sys.stderr)
        return 2
    print(f"load test of {t.name} v{t.version}: {args.requests} requests a level, closed loop")
    for line in compare_servers.lines(reports, args.target_qps, args.p99_ms):
        print(f"  {line}")
    if not args.no_log:
        run_id = compare_servers.log(reports, t, args.target_qps, args.p99_ms)
        print(f"  mlflow run {run_id} (tagged on the version as flyscale.loadtest_run)")
    return 0


def cmd_repository(args: argparse.Namespace) -> int:
    """Write a batching server's model repository for a registered version."""
    from pathlib import Path

    from mlflow.exceptions import MlflowException

    from flyscale.serving.repository import Batching, mlserver_repository, triton_repository

    out = Path(args.out)
    try:
        t = _served_version(args)
        batching = Batching(args.max_batch_size, args.max_delay_ms)
        if args.server == "mlserver":
            mlserver_repository(t.model_dir, out, t.name, batching)
            print(f"MLServer repository for {t.name} v{t.version} in {out}: mlserver start {out}")
            return 0
        onnx_files = sorted((t.model_dir / "artifacts").glob("*.onnx"))
        if not onnx_files:
            raise ValueError(f"{t.name} v{t.version} carries no ONNX file (a PyTorch model): Triton cannot serve it")
        triton_repository(onnx_files[0], out, t.name, batching)
    except (MlflowException, ValueError, OSError) as exc:
        print(f"flyscale repository: {exc}", file=sys.stderr)
        return 2
    print(f"Triton repository for {t.name} v{t.version} in {out}: tritonserver --model-repository {out.resolve()}")
    return 0


def cmd_huggingface(args: argparse.Namespace) -> int:
    """Write a registered version in Hugging Face's format, which transformers loads."""
    import json
    from pathlib import Path

    from mlflow.exceptions import MlflowException

    from flyscale.config import ModelConfig
    from flyscale.export.huggingface import save_pretrained
    from flyscale.plugin.records import as_dataset_info
    from flyscale.tracking.model_spec import artifact_files, build

    out = Path(args.out)
    try:
        t = _served_version(args)
        files = artifact_files(t.model_dir)
        if "spec" not in files or "weights" not in files:
            raise ValueError(
                f"{t.name} v{t.version} carries no flyscale weights and spec: it was not registered by flyscale"
            )
        spec = json.loads(files["spec"].read_text())
        if spec.get("quantizer"):
            raise ValueError(
                f"{t.name} v{t.version} is an int8 model; export its fp32 twin (--model {t.name.removesuffix('-int8')})"
            )
        info = as_dataset_info(spec["info"], f"{t.name} v{t.version}'s spec")
        tokenizer = files["tokenizer"].read_text() if "tokenizer" in files else ""
        model = build(spec, str(files["weights"]))
        save_pretrained(ModelConfig(**spec["model"]), info, model, tokenizer, out)
    except (MlflowException, ValueError, OSError) as exc:
        print(f"flyscale huggingface: {exc}", file=sys.stderr)
        return 2
    print(
        f"{t.name} v{t.version} in Hugging Face's format in {out}: transformers' from_pretrained({str(out)!r}) loads it"
    )
    return 0
