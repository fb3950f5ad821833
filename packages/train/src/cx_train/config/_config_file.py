"""`cx-train --config run.toml`: a TOML file of flag values, turned into command-line flags placed before the
command line's own, so that a flag given on the command line overrides the file (argparse keeps the last value).

Every flag has a key: its long name without the dashes, written with `-` or `_` (`batch-size = 8`,
`batch_size = 8`), or its destination (`verify = false` for `--no-verify`). On/off flags take `true` / `false`,
flags taking several values (`--data`) an array of strings. An unknown key is refused naming the key and the
closest flag; so is a value of the wrong kind. The resolved
config (every flag's value after the file and the command line) is written back as TOML by `resolved_toml`, which
`--config` reads again.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_ONLY_ON_COMMAND_LINE", "expand_config", "resolved_toml"]

CONFIG_ONLY_ON_COMMAND_LINE = ("config", "help")  # a config file cannot name another one
_NOT_WRITTEN = (*CONFIG_ONLY_ON_COMMAND_LINE, "dry_run")  # the resolved config is of a run, not of a dry run


def _config_path(argv: Sequence[str]) -> Path | None:
    found: Path | None = None
    for index, token in enumerate(argv):
        if token == "--config" and index + 1 < len(argv):
            found = Path(argv[index + 1])
        elif token.startswith("--config="):
            found = Path(token.split("=", 1)[1])
    return found


def _actions(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """Key -> (action, named by its flag): each long flag's name with - and with _, and each destination (for an
    on/off flag, `true` for a flag name means "given"; for a destination it is the value: `verify = false`)."""
    keys: dict[str, tuple[argparse.Action, bool]] = {}
    for action in parser._actions:  # argparse has no public list of its actions
        for option in action.option_strings:
            if option.startswith("--"):
                keys[option[2:]] = (action, True)
                keys[option[2:].replace("-", "_")] = (action, True)
        keys.setdefault(action.dest, (action, False))
    for name in CONFIG_ONLY_ON_COMMAND_LINE:
        keys.pop(name, None)
    return keys


def _closest(key: str, parser: argparse.ArgumentParser) -> str:
    flags = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--config"})
    match = difflib.get_close_matches("--" + key.replace("_", "-"), flags, n=1, cutoff=0.0)
    return match[0] if match else flags[0]


def _flag_tokens(path: Path, key: str, value: Any, action: argparse.Action, by_flag: bool) -> list[str]:
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} must be true or false, got {json.dumps(value)}")
        return [flag] if value == (True if by_flag else action.const) else []
    if action.nargs in ("+", "*"):  # a list flag (--data a.txt b.txt): a TOML array, or one string
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) for v in values):
            raise ValueError(f"--config {path}: {key} must be a string or a non-empty array of strings, got {value!r}")
        return [flag, *values]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"--config {path}: {key} must be a string or a number (as {flag} takes), got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--config {path}: {key} must be finite, got {value}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"--config {path}: {key} = {json.dumps(value)} is not one of {choices}")
    return [f"{flag}={value}"]


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path}: cannot read it ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--config {path}: not valid TOML ({error})") from None


def expand_config(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with the `--config` file's values as flags in front (raises ValueError naming the file and key)."""
    path = _config_path(argv)
    if path is None:
        return list(argv)
    values = _read(path)
    keys = _actions(parser)
    tokens: list[str] = []
    seen: dict[str, str] = {}
    for key, value in values.items():
        found = keys.get(key)
        if found is None:
            closest = _closest(key, parser)
            raise ValueError(f"--config {path}: unknown key {key!r} (the closest flag is {closest})")
        action, by_flag = found
        if action.dest in seen:
            raise ValueError(f"--config {path}: {key!r} and {seen[action.dest]!r} set the same flag")
        seen[action.dest] = key
        tokens += _flag_tokens(path, key, value, action, by_flag)
    return tokens + list(argv)


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def resolved_toml(values: Mapping[str, Any], header: str = "") -> str:
    """`values` (flag destination -> value, None for "not set": left out) as a TOML file `--config` reads back."""
    lines = [f"# {line}" for line in header.splitlines()]
    unset = [name for name, value in values.items() if value is None]
    for name, value in values.items():
        if value is not None and name not in _NOT_WRITTEN:
            lines.append(f"{name} = {_toml_value(value)}")
    if unset:
        lines.append(f"# not set (their defaults, per --help): {', '.join(unset)}")
    return "\n".join(lines) + "\n"
