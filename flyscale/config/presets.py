"""Presets as plain data: read from a file or inline JSON, merged in order, put in the shape the
sections decode.

`pyflyte run ... --cfg a.yaml --cfg '{"train": {"lr": 0.01}}'` merges the presets in the order
given: a later one overrides the fields it names and keeps the rest (mappings merge key by key;
a list, such as `gate` or `augment.names`, is replaced whole). Click keeps only the last value of
an option given twice, so the workflow input's `from_json` reads every `--cfg` of the command
line being parsed (the arguments click hands to the workflow's command) and merges them here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import yaml

from flyscale.config.strict import ConfigError

OPTION = "--cfg"  # the workflow input every flyscale workflow takes its config as


def read(value: str) -> Any:
    """A preset as pyflyte reads one: inline JSON, or a YAML (.yaml, .yml) or JSON file."""
    try:
        return json.loads(value)
    except ValueError:
        pass
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"{OPTION} {value!r}: neither inline JSON nor an existing file")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{OPTION} {value}: not valid {path.suffix.lstrip('.').upper() or 'JSON'}: {exc}") from None
    return data or {}


def normalise(data: Any) -> Any:
    """A pipeline preset with `gate:` as the section holds it: a list of gates, or one gate's
    mapping, becomes {"gates": [...]}."""
    if not isinstance(data, dict) or "gate" not in data:
        return data
    gate = data["gate"]
    if isinstance(gate, list):
        gate = {"gates": gate}
    elif isinstance(gate, dict) and gate and "gates" not in gate:
        gate = {"gates": [gate]}
    return {**data, "gate": gate}


def merge(*presets: Any, plugin_names: Mapping[str, str]) -> Any:
    """Later presets override earlier ones, field by field; lists are replaced whole. A section
    whose plugin a later preset changes takes only the later preset's options (the earlier
    plugin's would not fit it); `plugin_names` is {section: the field that names its plugin}."""
    out: Any = {}
    for preset in presets:
        over = normalise(preset or {})
        if isinstance(out, dict) and isinstance(over, dict):
            for section, name in plugin_names.items():
                before, after = out.get(section), over.get(section)
                if (
                    isinstance(before, dict)
                    and isinstance(after, dict)
                    and name in before
                    and name in after
                    and after[name] != before[name]
                ):
                    out = {**out, section: {k: v for k, v in before.items() if k != "options"}}
        out = _merged(out, over)
    return out


def _merged(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merged(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def given_on_command_line() -> list[str]:
    """The value of every `--cfg` on the pyflyte command line being parsed, in order; [] when
    no command line is being parsed (a notebook, a test).

    pyflyte builds the `--cfg` option itself from the workflow's input (flytekit's
    `to_click_option`: single-valued, with no hook for a multiple one), and click keeps only the
    last value of an option given twice; by the time an input is converted it has consumed the
    arguments. So they are read from the command line click parsed, the process's own
    (`sys.argv[1:]`, as click reads it): `pyflyte` is the process whenever a click context of
    pyflyte's is current. (The caller merges them only when the last one is the value click
    handed over.)"""
    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.find_root().info_name != "pyflyte":
        return []
    args = sys.argv[1:]
    values = []
    for i, arg in enumerate(args):
        if arg == OPTION and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(OPTION + "="):
            values.append(arg.split("=", 1)[1])
    return values


def refuse_missing_files() -> None:
    """Under `pyflyte run`, stop at a `--cfg` that names no file, saying so. (flytekit parses the
    last one itself before any of ours runs, and calls a path it cannot open "not a valid json
    object".) Called as the workflow's module loads; nothing outside a pyflyte command line."""
    for value in given_on_command_line():
        try:
            json.loads(value)
        except ValueError:
            if not Path(value).expanduser().is_file():
                raise click.BadParameter(
                    f"{value}: file not found (a YAML or JSON preset, or inline JSON)", param_hint=OPTION
                ) from None
