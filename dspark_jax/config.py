"""Python config files (``configs/*/*.py`` with ``get_config()``), CLI overrides, validation.

A config file returns an ``ml_collections.ConfigDict``. ``--config path.py[:arg]`` selects
it (``arg`` is passed to ``get_config`` when given) and ``--config.a.b=value`` overrides a
field; the value is parsed to the type of the existing field. Unknown keys and values
outside an allowed set fail at load with a message naming the key and the allowed values.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3Config

ConfigDict = ml_collections.ConfigDict

# Allowed values for enumerated fields, by dotted key. Modules that add enumerated fields
# register them here so the loader can name the allowed values in its error.
CHOICES: dict[str, Sequence[Any]] = {
    "model.preset": sorted(PRESETS) + [""],
    "model.dtype": ["float32", "bfloat16", "float16"],
    "model.param_dtype": ["float32", "bfloat16", "float16"],
}

# Extra validators by dotted key: callables raising ValueError with a clear message.
VALIDATORS: dict[str, Callable[[Any], None]] = {}


class ConfigError(ValueError):
    """A config file, override or value is wrong; the message says which and why."""


def load_config_file(spec: str) -> ConfigDict:
    """Load ``path.py`` or ``path.py:arg`` by calling its ``get_config([arg])``."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"Config file not found: {path}")
    module_name = "dspark_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"Config file {path} defines no get_config()")
    cfg = module.get_config(arg) if arg else module.get_config()
    if not isinstance(cfg, ConfigDict):
        raise ConfigError(f"{path}: get_config() must return an ml_collections.ConfigDict")
    return cfg


def _parse_value(text: str, current: Any, key: str) -> Any:
    if isinstance(current, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}: expected a boolean (true/false), got {text!r}")
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected an integer, got {text!r}") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--config.{key}: expected a number, got {text!r}") from None
    if isinstance(current, str):
        return text
    if isinstance(current, (tuple, list)) or current is None:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            if current is None:
                return text
            raise ConfigError(
                f"--config.{key}: expected a Python literal list/tuple, got {text!r}"
            ) from None
        if isinstance(current, tuple) and isinstance(value, list):
            value = tuple(value)
        if isinstance(current, tuple) and isinstance(value, int):
            value = (value,)
        return value
    raise ConfigError(f"--config.{key}: cannot override a field of type {type(current).__name__}")


def apply_override(cfg: ConfigDict, key: str, text: str) -> None:
    """Set dotted ``key`` to ``text`` parsed as the existing field's type."""
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "<top level>"
        if not isinstance(node, ConfigDict) or part not in node:
            allowed = sorted(node.keys()) if isinstance(node, ConfigDict) else []
            raise ConfigError(
                f"Unknown config key '{key}': no field '{part}' under {where}; "
                f"allowed keys there: {allowed}"
            )
        if depth == len(parts) - 1:
            with node.ignore_type():
                node[part] = _parse_value(text, node[part], key)
        else:
            node = node[part]


def split_config_args(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Pull ``--config FILE`` and ``--config.k=v`` out of ``argv``; return the rest too."""
    spec = None
    overrides: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file argument, e.g. --config configs/x.py")
            spec = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            spec = arg.split("=", 1)[1]
        elif arg.startswith("--config."):
            body = arg[len("--config.") :]
            if "=" in body:
                key, value = body.split("=", 1)
            elif i + 1 < len(argv):
                key, value = body, argv[i + 1]
                i += 1
            else:
                raise ConfigError(f"{arg} needs a value (--config.key=value)")
            overrides.append((key, value))
        else:
            rest.append(arg)
        i += 1
    return spec, overrides, rest


def validate(cfg: ConfigDict) -> None:
    """Check enumerated fields and registered validators; build the model config."""
    flat = _flatten(cfg)
    for key, allowed in CHOICES.items():
        if key in flat and flat[key] not in allowed:
            raise ConfigError(
                f"Invalid value {flat[key]!r} for config key '{key}'; allowed values: "
                f"{list(allowed)}"
            )
    for key, check in VALIDATORS.items():
        if key in flat:
            try:
                check(flat[key])
            except ValueError as e:
                raise ConfigError(f"Invalid value for config key '{key}': {e}") from None
    if "model" in cfg:
        model_config_from(cfg.model)


def update_config(cfg: ConfigDict, **sections: Any) -> ConfigDict:
    """Set fields of ``cfg`` by section, e.g. ``update_config(cfg, task="lm",
    train=dict(steps=40, lr=3e-3))``; returns ``cfg``. Every key must exist already, so a
    misspelt field in a config file fails the way a ``--config.`` override does."""
    for name, value in sections.items():
        if name not in cfg:
            raise ConfigError(f"Unknown config key '{name}'; known: {sorted(cfg)}")
        if not isinstance(value, dict):
            cfg[name] = value
            continue
        section = cfg[name]
        for key, v in value.items():
            if key not in section:
                raise ConfigError(f"Unknown config key '{name}.{key}'; known: {sorted(section)}")
            section[key] = v
    return cfg


def load_config(spec: str, overrides: Sequence[tuple[str, str]] = ()) -> ConfigDict:
    cfg = load_config_file(spec)
    for key, value in overrides:
        apply_override(cfg, key, value)
    validate(cfg)
    return cfg


def model_config_from(section: ConfigDict) -> Qwen3Config:
    """A ``Qwen3Config`` from a ``model`` section: a preset plus explicit field overrides."""
    values = section.to_dict()
    preset = values.pop("preset", "")
    base = PRESETS[preset] if preset else Qwen3Config()
    unknown = sorted(set(values) - set(Qwen3Config.field_names()))
    if unknown:
        raise ConfigError(
            f"Unknown model config key(s) {['model.' + k for k in unknown]}; allowed keys: "
            f"{['model.preset'] + ['model.' + n for n in Qwen3Config.field_names()]}"
        )
    values = {k: v for k, v in values.items() if v is not None}
    try:
        return base.replace(**values)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _flatten(cfg: ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in cfg.items():
        full = f"{prefix}{key}"
        if isinstance(value, ConfigDict):
            out.update(_flatten(value, full + "."))
        else:
            out[full] = value
    return out
