"""Reading cx-train's command line into flag values, with no heavy import (torch, cx-plugins, the data): `--help`
and every flag error (an unknown flag, a bad value, a bad choice) answer at once, as one line under a short usage,
and a misspelt flag names the closest one ("did you mean --steps?"), as an unknown config-file key does.

A negative number is a value (`--lr -1e-3`), not a flag; the `--config` file's values go in front of the command
line's own. What the values mean together is checked afterwards, in `_options`.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence

from cx_train.config._config_file import expand_config
from cx_train.config._parser import build_parser

__all__ = ["join_negative_values", "parse_arguments", "unrecognized"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """`--lr -1e-3` as `--lr=-1e-3`: argparse takes a negative number in exponent form (or -inf) for an option and
    says "expected one argument"; joined, the flag's own check says what is wrong with the value."""
    joined: list[str] = []
    for token in argv:
        previous = joined[-1] if joined else ""
        if token.startswith("-") and _is_number(token) and previous.startswith("--") and "=" not in previous:
            joined[-1] = f"{previous}={token}"
        else:
            joined.append(token)
    return joined


def unrecognized(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error for what argparse left over: the first unknown flag (or bare word) and the closest real flag."""
    flags = [token for token in extras if token.startswith("-")]
    if not flags:
        return f"unrecognized argument {extras[0]} (cx-train takes no bare words; flags start with --)"
    unknown = flags[0].split("=", 1)[0]
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]  # no public list
    match = difflib.get_close_matches(unknown, known, n=1)
    hint = f"did you mean {match[0]}?" if match else "cx-train --help lists the flags"
    return f"unrecognized argument {unknown} ({hint})"


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags' values after `--config` and the command line; exits with status 2 and one line on an error."""
    parser = build_parser()
    try:
        expanded = expand_config(join_negative_values(sys.argv[1:] if argv is None else argv), parser)
    except ValueError as error:
        parser.error(str(error))
    args, extras = parser.parse_known_args(expanded)
    if extras:
        parser.error(unrecognized(extras, parser))
    return args
