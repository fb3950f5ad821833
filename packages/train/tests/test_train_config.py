"""cx-train --config: keys for every flag, command-line flags override the file, unknown keys refused naming the
closest flag; --dry-run prints the resolved config, the parallel layout and the per-rank figures, then exits."""

from __future__ import annotations

from pathlib import Path

import pytest

from cx_train import main, parse_options
from cx_train._dry_run import layout_rows


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_train_config_file_sets_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = _write(
        tmp_path,
        'plugin = "torch_ddp"\nsteps = 30\nbatch-size = 4\nlr_schedule = "cosine"\nwarmup-steps = 3\n'
        "grad_accum = 2\nverify = false\nlr = 0.002\n",
    )
    options = parse_options(["--config", str(config), "--steps", "40"])
    assert (options.plugin, options.batch_size, options.lr) == ("torch_ddp", 4, 0.002)
    assert (options.lr_schedule, options.warmup_steps, options.grad_accum) == ("cosine", 3, 2)
    assert options.verify is False
    assert options.steps == 40  # the command line overrides the file
    assert parse_options(["--steps", "40", "--config", str(config)]).steps == 40  # wherever --config stands


def test_train_config_file_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text, message in [
        ("warmup = 5\n", "unknown key 'warmup' (the closest flag is --warmup-steps)"),
        ("batch = 5\n", "unknown key 'batch' (the closest flag is --batch-size)"),
        ('steps = "many"\n', "must be a positive integer"),
        ('lr-schedule = "step"\n', 'lr-schedule = "step" is not one of constant, linear, cosine'),
        ("compile = 1\n", "compile must be true or false"),
        ("steps = 3\nsteps_ = 1\n", "unknown key 'steps_'"),
        ("steps = [1]\n", "must be a string or a number"),
        ("steps = \n", "not valid TOML"),
    ]:
        with pytest.raises(SystemExit) as caught:
            parse_options(["--config", str(_write(tmp_path, text))])
        assert caught.value.code == 2
        assert message in capsys.readouterr().err, text
    with pytest.raises(SystemExit):
        parse_options(["--config", str(tmp_path / "missing.toml")])
    assert "no such file" in capsys.readouterr().err


def test_train_dry_run_prints_the_layout_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, 'plugin = "hybrid"\nnproc = 8\ntp = 2\npp = 2\nzero = 1\n')
    assert main(["--config", str(config), "--dry-run", "--steps", "7"]) == 0
    out = capsys.readouterr().out
    assert "nothing is trained" in out
    assert 'plugin = "hybrid"' in out
    assert "steps = 7" in out
    assert "dry_run" not in out
    assert "#   rank 0: dp=0 pp=0 tp=0 sp=0" in out
    assert "#   rank 5: dp=1 pp=0 tp=1 sp=0" in out  # (dp, pp, tp, sp) row-major: 5 = 1*4 + 0*2 + 1
    assert "#   rank 7: dp=1 pp=1 tp=1 sp=0" in out
    # the figures are the planner's (tested in test_train_dry_run.py)
    assert "# memory per rank (cx-plan, fp32, busiest pipeline stage" in out
    assert "optimizer states" in out


def test_train_dry_run_shows_the_dense_dp_rank_under_moe_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    # tp 2, ep 2 on 4 ranks: one moe_dp group, but the two ep coordinates train on different data, so the dense
    # parameters' data-parallel rank is (moe_dp, ep) row-major (the plugin's dp_size = moe_dp x ep = 2)
    argv = ["--plugin", "moe_hybrid", "--model", "mixtral", "--nproc", "4", "--tp", "2", "--ep", "2", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "#   rank 0: moe_dp=0 dp=0 pp=0 ep=0 tp=0 sp=0" in out
    assert "#   rank 1: moe_dp=0 dp=0 pp=0 ep=0 tp=1 sp=0" in out
    assert "#   rank 2: moe_dp=0 dp=1 pp=0 ep=1 tp=0 sp=0" in out
    assert "#   rank 3: moe_dp=0 dp=1 pp=0 ep=1 tp=1 sp=0" in out
    options = parse_options(["--plugin", "moe_hybrid", "--model", "mixtral", "--nproc", "8", "--ep", "2"])
    rows = layout_rows(options, 8)
    dense = [int(row.split(" dp=")[1].split()[0]) for row in rows]
    assert dense == list(range(8))  # moe_dp 4 x ep 2: every rank its own dense replica
    assert len(set(dense)) == options.data_parallel_size(8)


def test_train_config_file_lists_and_the_resolved_config_round_trip(tmp_path: Path) -> None:
    import tomllib

    from cx_train.config._config_file import expand_config, resolved_toml
    from cx_train.config._parser import build_parser

    config = _write(tmp_path, 'data = ["a.txt", "b/*.jsonl"]\nsteps = 5\n')
    tokens = expand_config(["--config", str(config), "--steps", "6"], build_parser())
    assert tokens[:4] == ["--data", "a.txt", "b/*.jsonl", "--steps=5"]
    args = build_parser().parse_args(tokens)
    assert (args.data, args.steps) == (["a.txt", "b/*.jsonl"], 6)
    written = tomllib.loads(resolved_toml({"data": [Path("a.txt")], "lr": 0.5, "verify": False, "save": None}))
    assert written == {"data": ["a.txt"], "lr": 0.5, "verify": False}
