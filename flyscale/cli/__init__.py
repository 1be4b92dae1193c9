"""The `flyscale` console command: plugins, checkpoints, the registry and served models.

    flyscale plugins                  # every installed plugin, by kind (plugin_list.py)
    flyscale plugins --kind models    # one kind only
    flyscale checkpoints              # the run folders checkpoints left behind (checkpoint_commands.py)
    flyscale outputs [--clear]        # what local runs keep of their tasks' files, with Flyte's local cache
    flyscale convert STEP_DIR --to safetensors --out DIR   # a checkpoint's model for Hugging Face
    flyscale tiny-checkpoint llama --out models/tiny-llama  # a small random checkpoint to fine-tune
    flyscale rollback --model NAME --to VERSION --reason "..."   # move `champion` back (registry_commands.py)
    flyscale promote --model NAME --version VERSION --reason "..." # a challenger becomes champion
    flyscale loadtest | repository | huggingface --model NAME ...  # a registered version, served or written out

Training and the other workflows are Flyte workflows, run with pyflyte, not commands of this tool.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flyscale.cli.checkpoint_commands import cmd_checkpoints, cmd_convert, cmd_outputs, cmd_tiny_checkpoint
from flyscale.cli.plugin_list import _summary, cmd_plugins, collect, render_plain, render_rich
from flyscale.cli.registry_commands import cmd_huggingface, cmd_loadtest, cmd_move, cmd_repository
from flyscale.flyte import heap
from flyscale.plugin import registry

__all__ = ["_summary", "build_parser", "collect", "main", "render_plain", "render_rich"]


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
    outs = sub.add_parser("outputs", help="the files local runs keep (~/.flyscale/outputs); --clear deletes them")
    outs.add_argument(
        "--clear",
        action="store_true",
        help="delete them, and empty Flyte's local cache (all of it, as `pyflyte local-cache clear`), which names them",
    )
    outs.set_defaults(func=cmd_outputs)
    convert = sub.add_parser(
        "convert", help="a checkpoint's model as Hugging Face safetensors, or safetensors as a DCP directory"
    )
    convert.add_argument(
        "source", help="a checkpoint's step directory (--to safetensors), or a folder of .safetensors (--to dcp)"
    )
    convert.add_argument("--to", choices=["safetensors", "dcp"], required=True, help="what to write")
    convert.add_argument("--out", required=True, help="the folder to write")
    convert.set_defaults(func=cmd_convert)
    tiny = sub.add_parser(
        "tiny-checkpoint", help="save a small random Hugging Face checkpoint (and its tokenizer) to fine-tune offline"
    )
    tiny.add_argument("arch", choices=["llama", "gpt2", "bert", "vit"], help="causal LMs, a text or image classifier")
    tiny.add_argument("--out", required=True, help="the folder to write (save_pretrained's layout)")
    tiny.add_argument("--labels", type=int, default=2, help="bert, vit: the classes the head predicts")
    tiny.add_argument("--image-size", type=int, default=32, help="vit: the images' height and width")
    tiny.add_argument("--channels", type=int, default=3, help="vit: the images' channels")
    tiny.add_argument("--width", type=int, default=64, help="the hidden size")
    tiny.add_argument("--layers", type=int, default=2, help="transformer layers")
    tiny.add_argument("--seed", type=int, default=0, help="the weights' seed")
    tiny.set_defaults(func=cmd_tiny_checkpoint)
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
    heap.end_without_collecting()  # it imports what a run does (flyscale/flyte/heap.py)
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
