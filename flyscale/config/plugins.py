"""From a section's plugin name and options to the plugin and its typed options.

A plugin's options are the plugin's own dataclass (`options_type`); the config holds them as a
mapping. They are checked here as strictly as the sections themselves (unknown names with the
nearest one suggested, then every value's type, then the dataclass's own `__post_init__`), so
`model.options.hidden: "abc"` is refused before any task runs, naming the option.

The mapping a section keeps is the options' canonical form (`canonical`): only the values that
differ from the plugin's defaults, as plain data. A preset that spells out a default and one that
leaves it out are then the same config, with the same cache keys; so is a run's own
`config.yaml`, fed back with `--cfg`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.errors import PydanticSchemaGenerationError, PydanticUndefinedAnnotation

from flyscale.config.base import Section
from flyscale.config.strict import ConfigError, check_keys, explain
from flyscale.plugin.registry import ALL, Resolved

_ADAPTERS: dict[type, TypeAdapter | None] = {}


def _adapter(opt_type: type) -> TypeAdapter | None:
    """pydantic's validator of a plugin's options dataclass; None for one it cannot describe
    (a field typed with an arbitrary class), which is then built as the plugin wrote it."""
    if opt_type not in _ADAPTERS:
        try:
            _ADAPTERS[opt_type] = TypeAdapter(opt_type)
        except (PydanticSchemaGenerationError, PydanticUndefinedAnnotation):
            _ADAPTERS[opt_type] = None
    return _ADAPTERS[opt_type]


def parse_options(plugin: Any, options: Mapping[str, Any] | None, where: str) -> Any:
    """A config mapping as the plugin's own options dataclass; every error names the option."""
    options = dict(options or {})
    opt_type = getattr(plugin, "options_type", None)
    if opt_type is None:
        if options:
            raise ConfigError(f"{where}: this plugin takes no options, got {sorted(options)}")
        return None
    check_keys(where, options, [f.name for f in dataclasses.fields(opt_type)], "option")
    adapter = _adapter(opt_type)
    try:
        if adapter is None:
            return opt_type(**options)
        return adapter.validate_json(json.dumps(options), strict=True)
    except ValidationError as exc:
        raise ConfigError(explain(exc, opt_type, where)) from None
    except (TypeError, ValueError) as exc:  # not plain data, or the dataclass's own check
        raise ConfigError(f"{where}: {exc}") from exc


def plain(parsed: Any) -> dict[str, Any]:
    """Parsed options as plain data (lists, not tuples): what YAML and JSON hold."""
    if parsed is None:
        return {}
    adapter = _adapter(type(parsed))
    return adapter.dump_python(parsed, mode="json") if adapter is not None else dataclasses.asdict(parsed)


def canonical(parsed: Any) -> dict[str, Any]:
    """The options as plain data, without the values that equal the plugin's defaults."""
    if parsed is None:
        return {}
    given = plain(parsed)
    try:
        defaults = plain(type(parsed)())
    except (TypeError, ValueError):  # an option without a default: every value is the user's
        return given
    return {k: v for k, v in given.items() if v != defaults.get(k)}


def resolve(kind: str, name: str, options: Mapping[str, Any] | None, field: str, options_field: str) -> Resolved:
    """The `kind` plugin called `name` with its parsed options; errors name `field` or `options_field`."""
    try:
        plugin = ALL[kind].get(name)
    except ValueError as exc:  # unknown, failed to import, or does not fit
        raise ConfigError(f"{field}: {exc}") from exc
    return Resolved(kind, name, plugin, parse_options(plugin, options, options_field))


class PluginSection(Section):
    """A section that names one plugin (in `name_field`) and holds its `options`."""

    _kind = ""
    _name_field = "name"

    def _plugin(self) -> Resolved:
        name, options, sec = getattr(self, self._name_field), self.options, self._section
        return self._resolved_once(
            (name, repr(options)),
            lambda: resolve(self._kind, name, options, f"{sec}.{self._name_field}", f"{sec}.options"),
        )

    def _canonical(self) -> None:
        """Resolve the plugin (the validation), and keep its options in their canonical form."""
        resolved = self._plugin()
        self.options = canonical(resolved.options)
        self.__dict__["_resolved"] = ((getattr(self, self._name_field), repr(self.options)), resolved)

    @property
    def plugin(self) -> Resolved:
        """The plugin and its parsed options."""
        return self._plugin()
