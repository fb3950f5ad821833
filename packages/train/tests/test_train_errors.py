"""cx-train's errors a user can read: bad numbers, damaged trainer.json, unusable --save / --resume paths, pipeline
sizes that really work, --help that shows every default, and a damaged checkpoint refused before any process starts.
(Ctrl-C is in test_train_interrupt.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from cx_mesh.testing import run_distributed
from cx_train import main, parse_options
from cx_train._cli import _verified
from cx_train._train import run
from cx_train.config._parser import build_parser

TINY = ["--nproc", "1", "--plugin", "torch_ddp", "--batch-size", "2", "--seq-len", "16", "--hidden-size", "32"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        parse_options(argv)
    assert caught.value.code == 2
    return " ".join(capsys.readouterr().err.split())  # argparse wraps long messages


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "inf"], "argument --lr: must be a finite positive number, got 'inf'"),
        (["--lr", "nan"], "argument --lr: must be a finite positive number, got 'nan'"),
        (["--lr", "-inf"], "argument --lr: must be a finite positive number, got '-inf'"),
        (["--lr", "-1e-3"], "argument --lr: must be positive, got -0.001"),  # was "expected one argument"
        (["--lr=-1e-3"], "argument --lr: must be positive, got -0.001"),
        (["--steps", "inf"], "argument --steps: must be a positive integer, got 'inf'"),
        (["--batch-size", "-1e3"], "argument --batch-size: must be a positive integer, got '-1e3'"),
        (["--seed", "nan"], "argument --seed: must be an integer, got 'nan'"),
        (["--save-every", "1.5"], "argument --save-every: must be an integer, got '1.5'"),
    ],
)
def test_train_errors_numbers(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    error = _refused(argv, capsys)
    assert message in error
    assert "expected one argument" not in error


def test_train_errors_negative_numbers_still_parse_where_allowed() -> None:
    assert parse_options(["--seed", "-5", "--lr", "2e-3"]).seed == -5
    assert parse_options(["--lr", "2e-3"]).lr == 2e-3


def _checkpoint_folder(tmp_path: Path, trainer_json: str) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "trainer.json").write_text(trainer_json)
    return folder


_VALID = json.dumps(
    {"step": 5, "plugin": "gemini", "world_size": 2, "model": "gpt", "hidden_size": 32, "num_layers": 2}
)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_VALID[: len(_VALID) // 2], "not valid JSON"),  # truncated
        (_VALID + '{"step": 7}', "not valid JSON (Extra data"),  # extended past the object
        (_VALID[:-1] + ', "lr": 0.1}', "unknown field(s) lr"),
        (json.dumps({"plugin": "gemini", "world_size": 2}), "missing field(s) step"),
        (_VALID.replace('"step": 5', '"step": "5"'), '"step" must be an integer, got "5"'),
        ("[5]", "expected a JSON object, got list"),
    ],
)
def test_train_errors_damaged_trainer_json_names_the_file(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _checkpoint_folder(tmp_path, content)
    error = _refused([*TINY, "--resume", str(folder)], capsys)
    assert f"{folder / 'trainer.json'}: " in error
    assert message in error


def test_train_errors_resume_of_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    error = _refused(["--resume", str(tmp_path / "nowhere")], capsys)
    assert f"--resume {tmp_path / 'nowhere'}: no such directory" in error
    assert "trainer.json" not in error


@pytest.mark.parametrize("steps", ["5", "3"])
def test_train_errors_resume_at_or_past_steps(tmp_path: Path, steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It exited 0 having trained and saved nothing; now it is refused (exit 2) saying why."""
    folder = _checkpoint_folder(tmp_path, _VALID)
    error = _refused([*TINY, "--resume", str(folder), "--steps", steps], capsys)
    assert f"already at step 5 >= --steps {steps}" in error
    assert "--steps is the total to reach" in error
    assert parse_options([*TINY, "--resume", str(folder), "--steps", "6"]).steps == 6


def test_train_errors_save_path_checked_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "exists and is not a directory" in _refused(["--save", str(a_file)], capsys)
    assert f"{a_file} is not a directory" in _refused(["--save", str(a_file / "ckpt")], capsys)
    assert parse_options(["--save", str(tmp_path / "new" / "ckpt")]).save == tmp_path / "new" / "ckpt"
    # the other paths a run writes, checked up front too (--metrics was checked only after the ranks started, the
    # token cache's folder by a bare OSError from its lock file)
    assert f"--metrics {a_file / 'm.jsonl'}: {a_file} is not a directory" in _refused(
        ["--metrics", str(a_file / "m.jsonl")], capsys
    )
    assert f"--data-cache-dir {a_file / 'cache'}: {a_file} is not a directory" in _refused(
        ["--data-cache-dir", str(a_file / "cache")], capsys
    )
    assert parse_options(["--metrics", str(tmp_path / "new" / "m.jsonl")]).metrics == tmp_path / "new" / "m.jsonl"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any directory")
def test_train_errors_save_in_a_read_only_parent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert f"cannot write in {locked}" in _refused(["--save", str(locked / "ckpt")], capsys)
        assert f"cannot write in {locked}" in _refused(["--metrics", str(locked / "m.jsonl")], capsys)
        assert f"cannot write in {locked}" in _refused(["--data-cache-dir", str(locked)], capsys)
    finally:
        locked.chmod(0o700)


def _suggested_pp(error: str) -> list[str]:
    match = re.search(r"use --pp ([0-9, ]+)", error)
    return [] if match is None else [v for v in match.group(1).replace(",", " ").split()]


@pytest.mark.parametrize(
    "argv",
    [
        ["--pp", "2", "--pp-style", "interleaved"],  # 2 layers: no pipeline size works with two chunks per stage
        ["--pp", "2", "--pp-style", "interleaved", "--num-layers", "6", "--nproc", "6"],
        ["--pp", "3", "--pp-style", "interleaved", "--num-layers", "4", "--nproc", "6"],
        ["--pp", "4", "--num-layers", "6", "--nproc", "4"],
    ],
)
def test_train_errors_pipeline_suggestions_work(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Every suggested --pp parses with the same flags (it used to suggest the failing value, and 1)."""
    flags = ["--plugin", "hybrid", *argv]
    error = _refused(flags, capsys)
    pp = flags[flags.index("--pp") + 1]
    assert pp not in _suggested_pp(error), error
    for suggestion in _suggested_pp(error):
        assert parse_options([*flags, "--pp", suggestion]).pp == int(suggestion)
    if "--pp-style 1f1b" in error:
        assert parse_options([*flags, "--pp-style", "1f1b"]).pp == int(pp)
    if argv[:4] == ["--pp", "2", "--pp-style", "interleaved"] and len(argv) == 4:
        assert _suggested_pp(error) == []
        assert "--num-layers 4" in error
        assert parse_options([*flags, "--num-layers", "4"]).pp == 2


def test_train_errors_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    actions = build_parser()._actions
    # every option of the parser (positionals and subcommands have no option strings; `plot` is a word main reads)
    options = [a for a in actions if a.option_strings and a.option_strings != ["-h", "--help"]]
    assert len(options) > 40, [a.option_strings for a in actions]  # the loop below sees all of cx-train's flags
    starts = []
    for action in options:
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help text"
        assert not action.help.startswith("(default"), f"{flag} has no help text"
        match = re.search(rf"\n  {flag}[ \n]", text)
        assert match, f"{flag} is not in --help"
        starts.append((match.start(), action))
    starts.sort(key=lambda found: found[0])
    ends = [start for start, _ in starts[1:]] + [len(text)]
    for (start, action), end in zip(starts, ends, strict=True):
        flag, entry = action.option_strings[0], " ".join(text[start:end].split())
        assert "(default:" in entry, f"{flag} shows no default: {entry!r}"
        if "(default" not in str(action.help):  # argparse's own "(default: X)" is the value the flag really takes
            assert f"(default: {action.default})" in entry, f"{flag} shows another default: {entry!r}"
    steps = " ".join(text[text.index("\n  --steps") :].split())
    assert "with --resume, the total" in steps


def _train_tiny(rank: int, world_size: int, directory: str) -> None:
    run(parse_options([*TINY, "--steps", "2", "--log-every", "100", "--save", directory]))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo") / "ckpt"
    run_distributed(_train_tiny, 1, directory=str(directory))
    return directory


def test_train_errors_resume_with_another_seq_len_names_the_tensor(
    saved_checkpoint: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The GPT's learned position table follows --seq-len: resumed at another, every rank used to start, load and
    fail with a tensor-shape traceback; now one line names both --seq-len values (from the checkpoint's config.toml),
    and, for a checkpoint without its config, the tensor and both shapes."""
    error = _refused([*TINY, "--steps", "5", "--seq-len", "32", "--resume", str(saved_checkpoint)], capsys)
    assert (
        f"--resume {saved_checkpoint}: the checkpoint's run had --seq-len 16, this run has --seq-len 32; resume "
        "with --seq-len 16"
    ) in error
    bare = tmp_path / "bare"
    shutil.copytree(saved_checkpoint, bare)
    (bare / "config.toml").unlink()
    error = _refused([*TINY, "--steps", "5", "--seq-len", "32", "--no-verify", "--resume", str(bare)], capsys)
    assert (
        f"--resume {bare}: the checkpoint's embed_positions.weight is [17, 32], this run's model has [33, 32]; "
        "resume with the sizes it was trained with"
    ) in error
    assert parse_options([*TINY, "--steps", "5", "--resume", str(saved_checkpoint)]).resume == saved_checkpoint


def test_train_errors_resume_verifies_the_checkpoint(
    saved_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped bit in a shard loaded without a word; now the launcher refuses it before starting any process,
    naming the file, and --no-verify skips the check."""
    resume = [*TINY, "--steps", "5"]
    assert _verified(parse_options([*resume, "--resume", str(saved_checkpoint)]))
    damaged = tmp_path / "damaged"
    shutil.copytree(saved_checkpoint, damaged)
    shard = sorted((damaged / "model").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last byte is tensor data: the file still parses and loads
    shard.write_bytes(bytes(data))
    capsys.readouterr()

    assert main([*resume, "--resume", str(damaged)]) == 2
    error = capsys.readouterr().err
    assert f"--resume {damaged}: the checkpoint is damaged" in error
    assert str(shard) in error
    assert "--no-verify" in error
    assert main([*resume, "--resume", str(damaged), "--dry-run"]) == 2  # a dry run checks what the run would load
    assert f"--resume {damaged}: the checkpoint is damaged" in capsys.readouterr().err

    skipping = parse_options([*resume, "--resume", str(damaged), "--no-verify"])
    assert not skipping.verify
    assert _verified(skipping)
    assert capsys.readouterr().err == ""
