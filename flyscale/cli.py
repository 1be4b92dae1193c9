"""The `flyscale` console command.

    flyscale plugins                  # every installed plugin, by kind
    flyscale plugins --kind models    # one kind only
    flyscale rollback --model NAME --to VERSION --reason "..."   # move `champion` back
    flyscale promote --model NAME --version VERSION --reason "..." # a challenger becomes champion

Each plugin is shown with its entry point ("module:attr"), the installed distribution that
declared it (name and version), and whether it can be used: it imports, and it fits its kind's
contract (every required method, callable with the arguments flyscale passes). A broken plugin
is listed with the reason and the command still exits 0: one bad package must not hide what
else is installed.
On a terminal the listing is a rich table; piped, it is one plain line per plugin, so `grep`
sees whole lines rather than cells wrapped at 80 columns.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence

from flyscale.plugin import registry
from flyscale.plugin.registry import PluginInfo


def collect(kinds: Iterable[str]) -> list[PluginInfo]:
    """Every plugin of `kinds`, each one loaded and checked (its errors are captured, not raised)."""
    return [info for kind in kinds for info in registry.ALL[kind].info()]


def _status(info: PluginInfo) -> str:
    return "ok" if info.error is None else f"broken: {info.error}"


def render_plain(infos: Sequence[PluginInfo], out) -> None:
    """One line per plugin, columns aligned, nothing wrapped."""
    rows = [(i.kind, i.name, i.value, i.distribution, _status(i)) for i in infos]
    header = ("KIND", "NAME", "ENTRY POINT", "DISTRIBUTION", "STATUS")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(4)]
    for row in [header, *rows]:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] + "\n")


def render_rich(infos: Sequence[PluginInfo], console) -> None:
    """A table per kind, errors in red."""
    from rich.markup import escape
    from rich.table import Table

    for kind in dict.fromkeys(i.kind for i in infos):
        table = Table(title=f"flyscale.{kind}", title_justify="left")
        for column in ("name", "entry point", "distribution", "status"):
            table.add_column(column, overflow="fold")
        for i in (i for i in infos if i.kind == kind):
            status = "[green]ok[/green]" if i.error is None else f"[red]broken:[/red] {escape(i.error)}"
            table.add_row(i.name, i.value, i.distribution, status)
        console.print(table)


def _summary(infos: Sequence[PluginInfo]) -> str:
    broken = [i for i in infos if i.error is not None]
    text = f"{len(infos)} plugins, {len(broken)} broken"
    if broken:
        text += ": " + ", ".join(f"{i.kind}/{i.name} ({i.distribution})" for i in broken)
    return text


def cmd_plugins(args: argparse.Namespace) -> int:
    """List installed plugins; exit 0 even when some are broken (their errors are shown)."""
    infos = collect([args.kind] if args.kind else list(registry.ALL))
    if sys.stdout.isatty() and not args.plain:
        from rich.console import Console

        console = Console()
        render_rich(infos, console)
        console.print(_summary(infos), markup=False, highlight=False)
    else:
        render_plain(infos, sys.stdout)
        print(_summary(infos))
    return 0


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


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """List the run directories under the checkpoint base; with --prune-days, delete the old ones."""
    import time

    from flyscale.train.run_dirs import base_directory, prune, run_directories

    base = args.dir or ""
    print(f"checkpoints under {base_directory(base)}")
    if args.prune_days is not None:
        gone = prune(base, args.prune_days * 86400)
        print(f"deleted {len(gone)} run folder(s) not written for {args.prune_days:g} day(s)")
        for path in gone:
            print(f"  {path}")
    runs = run_directories(base)
    for run in runs:
        age_h = (time.time() - run.modified) / 3600
        steps = f"steps {run.steps[0]}..{run.steps[-1]}" if run.steps else "no complete checkpoint"
        held = "  (in use: a run is training in it)" if run.held else ""
        print(f"  {run.path}  {steps}  {run.bytes / 2**20:.1f} MiB  last written {age_h:.1f} h ago{held}")
    if not runs:
        print("  none")
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


def _version_parser(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand about one registered version, served with batching."""
    p = sub.add_parser(name, help=text)
    p.add_argument("--model", required=True, help="registered model name")
    p.add_argument("--version", default="", help="the version (default: the one --alias points at)")
    p.add_argument("--alias", default="champion", help="the alias to use when no --version is given")
    p.add_argument("--max-batch-size", type=int, default=32, help="batching: rows a batch at most")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="batching: the longest a request waits for a batch")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flyscale",
        description="flyscale command-line tools: plugins, checkpoints, the registry and served models.",
        # Training and the other workflows are Flyte workflows, run with pyflyte, not commands of this tool.
        epilog=(
            "To train: pyflyte run workflows/train.py training_pipeline [--cfg configs/quick.yaml] (from the "
            "repository; `make run` does the same). Search, scaling studies, batch prediction and data preparation "
            "are the other workflows: workflows/search.py hyperparameter_search, workflows/scaling.py scaling_study, "
            "workflows/predict.py batch_predict, workflows/data.py prepare_data. See README.md and docs/."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list installed plugins by kind, with where each came from")
    plugins.add_argument("--kind", choices=sorted(registry.ALL), help="show only this kind of plugin")
    plugins.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    plugins.set_defaults(func=cmd_plugins)
    ckpts = sub.add_parser("checkpoints", help="list the checkpoints runs left behind; --prune-days deletes old ones")
    ckpts.add_argument(
        "--dir", default="", help="the checkpoint base (recovery.checkpoint_dir; default ~/.flyscale/checkpoints)"
    )
    ckpts.add_argument(
        "--prune-days", type=float, default=None, help="delete run folders not written for this many days"
    )
    ckpts.set_defaults(func=cmd_checkpoints)
    for name, flag, text in (
        ("rollback", "--to", "point the alias back at an earlier version"),
        ("promote", "--version", "point the alias at a version (a challenger, say)"),
    ):
        move = sub.add_parser(name, help=f"{text}; who and why are recorded as tags")
        move.add_argument("--model", required=True, help="registered model name (its -int8 twin moves with it)")
        move.add_argument(flag, required=True, dest=flag[2:], help="the version the alias should point at")
        move.add_argument("--reason", required=True, help="why: recorded with the move")
        move.add_argument("--alias", default="champion", help="the alias to move (default: champion)")
        move.add_argument("--who", default="", help="who decided (default: $USER)")
        move.set_defaults(func=cmd_move)
    lt = _version_parser(sub, "loadtest", "serve a registered version on loopback and measure it under load")
    lt.add_argument(
        "--setups",
        default="mlflow,mlserver,mlserver-batching",
        help="servers to measure, side by side: mlflow (no batching), mlserver (batching off), mlserver-batching",
    )
    lt.add_argument("--levels", default="1,4,16,64", help="concurrent clients, one level each")
    lt.add_argument("--requests", type=int, default=200, help="requests a level (at least 4 a client)")
    lt.add_argument("--target-qps", type=float, default=1000.0, help="for the replicas estimate")
    lt.add_argument("--p99-ms", type=float, default=100.0, help="the p99 latency the replicas estimate must keep")
    lt.add_argument("--envs", default="~/.cache/flyscale/serving", help="where serving environments are built")
    lt.add_argument("--no-log", action="store_true", help="print only; log nothing to MLflow")
    lt.set_defaults(func=cmd_loadtest)
    repo = _version_parser(sub, "repository", "write an MLServer or Triton model repository for a registered version")
    repo.add_argument("--server", choices=["triton", "mlserver"], required=True)
    repo.add_argument("--out", required=True, help="the repository folder to write")
    repo.set_defaults(func=cmd_repository)
    hf = sub.add_parser(
        "huggingface",
        help="write a registered version in Hugging Face's format (config.json, model.safetensors, tokenizer)",
    )
    hf.add_argument("--model", required=True, help="registered model name")
    hf.add_argument("--version", default="", help="the version (default: the one --alias points at)")
    hf.add_argument("--alias", default="champion", help="the alias to use when no --version is given")
    hf.add_argument("--out", required=True, help="the folder to write")
    hf.set_defaults(func=cmd_huggingface)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flyscale` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # MLflow's errors: one line, as the tracking store's, never its password
        from mlflow.exceptions import MlflowException

        if not isinstance(exc, MlflowException):
            raise
        from flyscale.tracking.store import refusal, shown, tracking_uri

        uri = tracking_uri()
        refused = refusal(exc)
        if refused:  # 401/403: what to export or whom to ask, not the server's HTML or its URL
            print(f"flyscale {args.command}: refused: {refused}", file=sys.stderr)
            return 1
        said = str(exc).replace(uri, shown(uri)).splitlines()[0]
        print(f"flyscale {args.command}: the tracking store at {shown(uri)} failed: {said}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
