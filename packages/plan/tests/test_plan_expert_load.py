"""A measured expert-load histogram (`--expert-load FILE`, cx-train's `--metrics` expert_counts): each ep size's
candidates get the hottest ep rank's share of that histogram as their routing skew, worked out by hand below; the
file forms and the mistakes (no counts, another expert count, both routing flags) get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_plan import load_model_shape
from cx_plan._cli import main
from cx_plan._enumerate import SearchSpace, enumerate_candidates
from cx_plan._expert_load import ExpertLoad, read_expert_load
from cx_plan.trace._model_spec import ModelShape
from test_plan_routing_skew import _stub

SEQ = 32
# 2 MoE layers x 4 experts (the mixtral preset, top 2); layer 1 is the hotter one at ep 2, layer 0 at ep 4
COUNTS = [[10, 50, 20, 20], [40, 30, 10, 20]]


@pytest.fixture(scope="module")
def mixtral() -> ModelShape:
    return load_model_shape("mixtral", hidden_size=64, num_layers=2, seq_len=SEQ)


def test_hot_rank_share_by_hand() -> None:
    load = ExpertLoad(tuple(tuple(float(x) for x in row) for row in COUNTS), "test")
    # ep 2, layer 0: ranks hold 60 / 40 of 100 -> 1.2; layer 1: 70 / 30 -> 1.4
    assert load.hot_rank_share(2) == pytest.approx(1.4)
    # ep 4 (one expert each), layer 0: 50 of 100 over the mean 25 -> 2.0; layer 1: 40 / 25 -> 1.6
    assert load.hot_rank_share(4) == pytest.approx(2.0)
    assert load.hot_rank_share(1) == 1.0
    with pytest.raises(ValueError, match="ep 3 does not divide the 4 experts"):
        load.hot_rank_share(3)


def test_metrics_file_sums_every_record_and_reaches_the_candidates(
    tmp_path: Path, mixtral: ModelShape, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = tmp_path / "metrics.jsonl"
    halves = [[[x / 2 for x in row] for row in COUNTS]] * 2  # two log windows, each half the tokens
    lines = [json.dumps({"step": 2 * i + 2, "loss": 1.0, "expert_counts": h}) for i, h in enumerate(halves)]
    metrics.write_text("\n".join([json.dumps({"step": 0, "loss": 2.0}), *lines]) + "\n")
    load = read_expert_load(metrics)
    assert load.counts == tuple(tuple(float(x) for x in row) for row in COUNTS)
    found = enumerate_candidates(mixtral, 8, SEQ, SearchSpace(plugins=("moe_hybrid",), expert_load=load))
    by_ep = {c.ep: c.routing_skew for c in found}
    assert by_ep[2] == pytest.approx(1.4)
    assert by_ep[4] == pytest.approx(2.0)
    flags = ["--model", "mixtral", "--hidden-size", "64", "--num-layers", "2", "--seq-len", str(SEQ), "--world", "4",
             "--device", "cpu", "--plugins", "moe_hybrid", "--quiet"]  # fmt: skip
    assert main([*flags, "--expert-load", str(metrics)], memory_factory=_stub) == 0
    out = capsys.readouterr().out
    assert (
        f"expert load from {metrics} (2 layers x 4 experts): the hottest ep rank's share ep 2 x1.40, ep 4 x2.00" in out
    )


def test_expert_load_mistakes_are_named(
    tmp_path: Path, mixtral: ModelShape, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "dense.jsonl"
    empty.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no record has expert_counts"):
        read_expert_load(empty)
    eight = tmp_path / "eight.json"
    eight.write_text(json.dumps({"expert_counts": [[1, 2, 3, 4, 5, 6, 7, 8]]}))
    with pytest.raises(ValueError, match="counts 8 experts per layer, the model has 4"):
        enumerate_candidates(mixtral, 2, SEQ, SearchSpace(expert_load=read_expert_load(eight)))
    ragged = tmp_path / "ragged.json"
    ragged.write_text(json.dumps([[1, 2], [3]]))
    with pytest.raises(ValueError, match="every layer must list the same number of experts"):
        read_expert_load(ragged)
    load = ExpertLoad(((1.0,) * 4,), "x")
    with pytest.raises(ValueError, match="either as --routing-skew or as --expert-load"):
        enumerate_candidates(mixtral, 2, SEQ, SearchSpace(routing_skew=1.5, expert_load=load))
    flags = ["--model", "mixtral", "--hidden-size", "64", "--num-layers", "2", "--seq-len", str(SEQ), "--world", "2",
             "--device", "cpu", "--plugins", "moe_hybrid", "--quiet"]  # fmt: skip
    assert main([*flags, "--expert-load", str(tmp_path / "missing.json")], memory_factory=_stub) == 2
    assert "cannot read it" in capsys.readouterr().err
