"""`flyscale plugins`: every installed plugin, by kind, with its entry point, the distribution that
declared it and whether it can be used. A broken plugin is listed with the reason and the command
still exits 0: one bad package must not hide what else is installed. On a terminal the listing is
a rich table; piped, one plain line per plugin, so `grep` sees whole lines."""

from __future__ import annotations

import argparse
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
