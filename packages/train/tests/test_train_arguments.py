"""cx-train reads its flags before any heavy import: `--help` and a flag error leave torch, cx-plugins and
transformers unimported (run through the real entry point in a fresh interpreter), a misspelt flag is one line
naming the closest flag under a short usage, and the constants kept here to avoid those imports agree with their
owners."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cx_mesh import DEFAULT_TIMEOUT
from cx_plugins import models as plugin_models
from cx_train.config._arguments import parse_arguments
from cx_train.config._parser import DEFAULT_TIMEOUT_S
from cx_train.models import _names

HEAVY = ("torch", "cx_plugins", "cx_mesh", "transformers")

_ENTRY = """
import json, runpy, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["cx-train", *json.loads(sys.argv[1])]
try:
    runpy.run_module("cx_train", run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": [m for m in heavy if m in sys.modules]}))
"""


def _entry_point(argv: list[str]) -> tuple[dict[str, object], str]:
    """`python -m cx_train ARGV` in a fresh interpreter: its exit status and heavy modules, and its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _ENTRY, json.dumps(argv), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--stpes", "100"], 2),  # unknown flag
        (["--steps", "many"], 2),  # bad value
        (["--plugin", "ddp"], 2),  # bad choice
    ],
)
def test_train_arguments_answer_before_heavy_imports(argv: list[str], code: int) -> None:
    result, _ = _entry_point(argv)
    assert result == {"code": code, "heavy": []}


def test_train_arguments_misspelt_flag_is_one_line_with_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_arguments(["--stpes", "100"])
    assert caught.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: cx-train [--FLAG VALUE ...]")
    assert error == "cx-train: error: unrecognized argument --stpes (did you mean --steps?)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-sise=4"], "unrecognized argument --batch-sise (did you mean --batch-size?)"),
        (["--zzzz"], "unrecognized argument --zzzz (cx-train --help lists the flags)"),
        (["llama"], "unrecognized argument llama (cx-train takes no bare words; flags start with --)"),
    ],
)
def test_train_arguments_unrecognized(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_arguments(argv)
    assert capsys.readouterr().err.splitlines()[-1] == f"cx-train: error: {message}"


def test_train_arguments_local_constants_agree_with_their_owners() -> None:
    assert DEFAULT_TIMEOUT.total_seconds() == DEFAULT_TIMEOUT_S
    assert (_names.GPT_MODEL, _names.PRESETS, _names.MODEL_CHOICES) == (
        plugin_models.GPT_MODEL,
        plugin_models.PRESETS,
        plugin_models.MODEL_CHOICES,
    )
