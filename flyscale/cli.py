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

    from flyscale.tracking import champion
    from flyscale.tracking import store as mlflow_store

    action = "rollback" if args.command == "rollback" else "promote"
    version = args.to if action == "rollback" else args.version
    who = args.who or os.environ.get("USER") or getpass.getuser()
    uri = mlflow_store.tracking_uri()
    print(f"tracking store: {uri}", file=sys.stderr)
    missing = mlflow_store.missing_local_store(uri)
    if missing:  # opening it would create an empty store, in which nothing is registered
        print(f"flyscale {args.command}: {missing}", file=sys.stderr)
        return 2
    try:
        note = champion.move_alias(MlflowClient(uri), args.model, args.alias, version, action, who, args.reason)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flyscale", description="flyscale command-line tools")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `flyscale` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
