"""cx-train --data training runs: the loss falls (reference GPT on UTF-8 bytes, a tiny Llama folder with its own
tokenizer), a run resumed mid-epoch gives exactly the losses and parameters of the run that never stopped (evaluation
in between changes nothing), resuming at another data-parallel size with the same global batch trains on exactly the
same batches and a different global batch is refused."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch

import cx_train._train as train_module
from cx_mesh.testing import run_distributed, sum_tolerance
from cx_train import parse_options
from cx_train._train import run
from cx_train.data._packing import PackedBatch
from cx_train.data._text_sources import DataError
from cx_train.data._user_data import open_user_data
from cx_train.data._user_loader import open_loader
from cx_train.models._plugins import make_plugin
from cx_train.models._spec import build_model, describe_model
from cx_train.step._evaluation import evaluate
from cx_train.step._optimization import micro_step
from train_data_helpers import TINY_GPT, assert_same_weights, tiny_llama_folder, write_jsonl, write_text


def _train(rank: int, world_size: int, flags: list[str], out: str, batches: str | None = None) -> None:
    """Train; rank 0 writes the losses to `out`. With `batches`, each rank also saves the windows of every optimizer
    step it trained on (what the model saw, after the loop's mid-epoch skip) to `<batches>.<rank>.pt`."""
    seen: list[torch.Tensor] = []

    def recording(booster: Any, model: Any, optimizer: Any, step_batches: list[PackedBatch], *rest: Any) -> Any:
        seen.append(torch.cat([torch.stack([b.input_ids, b.labels, b.position_ids], dim=1) for b in step_batches]))
        return micro_step(booster, model, optimizer, step_batches, *rest)

    patched = patch.object(train_module, "micro_step", recording) if batches is not None else nullcontext()
    with patched:
        losses = run(parse_options(flags, world_size=world_size))
    if batches is not None:
        torch.save(torch.stack(seen), f"{batches}.{rank}.pt")
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def _batches(path: Path, rank: int) -> torch.Tensor:
    loaded = torch.load(f"{path}.{rank}.pt", weights_only=True)
    assert isinstance(loaded, torch.Tensor)
    return loaded


def _refused(rank: int, world_size: int, flags: list[str]) -> None:
    with pytest.raises(DataError, match="resume with the global batch of the run that saved it"):
        run(parse_options(flags, world_size=world_size))


def _losses(path: Path) -> list[float]:
    return [float(v) for v in json.loads(path.read_text())]


def test_train_data_resume_mid_epoch_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    write_text(tmp_path / "a.txt", 600, seed=1)  # 601 + 5 x 121 tokens: 70 windows of 17, 7 held out for eval
    write_jsonl(tmp_path / "b.jsonl", 5, seed=2)
    data = ["--data", str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"), "--eval-fraction", "0.1"]
    flags = [*TINY_GPT, *data, "--plugin", "torch_ddp", "--batch-size", "4", "--eval-every", "3", "--log-every", "100"]
    parse_options([*flags, "--steps", "12"], world_size=2)  # tokenises once, as the launcher does
    ckpt, batches = tmp_path / "ckpt", tmp_path / "batches"
    batches.mkdir()
    whole_flags = [*flags, "--steps", "12", "--save", str(tmp_path / "whole")]
    run_distributed(_train, 2, flags=whole_flags, out=str(tmp_path / "whole.json"), batches=str(batches / "whole"))
    run_distributed(_train, 2, flags=[*flags, "--steps", "5", "--save", str(ckpt)], out=str(tmp_path / "a.json"))
    saved = json.loads((ckpt / "trainer.json").read_text())
    assert (saved["data_epoch"], saved["data_offset"]) == (0, 40)  # 5 steps x 8 windows; 63 // 8 = 7 steps an epoch
    resume = [*flags, "--steps", "12", "--resume", str(ckpt)]
    run_distributed(_train, 2, flags=[*resume, "--save", str(tmp_path / "b")], out=str(tmp_path / "b.json"))
    whole = _losses(tmp_path / "whole.json")
    assert _losses(tmp_path / "a.json") + _losses(tmp_path / "b.json") == whole  # bit for bit: same batches, same math
    assert_same_weights(tmp_path / "whole", tmp_path / "b")
    assert sum(whole[-3:]) < sum(whole[:3]) - 3 * 0.5, whole  # ln 257 = 5.5 nats falls fast on repetitive text
    # one process under another plugin with the same global batch continues at the same position: it trains on
    # exactly the windows the two ranks trained on together (rank 0's half first); another global batch is refused
    other = [*resume, "--batch-size", "8", "--plugin", "low_level_zero"]
    run_distributed(_train, 1, flags=other, out=str(tmp_path / "c.json"), batches=str(batches / "c"))
    together = torch.cat([_batches(batches / "whole", 0), _batches(batches / "whole", 1)], dim=1)
    assert together.shape == (12, 8, 3, 17)  # input ids, labels, position ids
    assert torch.equal(_batches(batches / "c", 0), together[5:])
    # Its first loss comes from the same parameters (the checkpoint) on the same 8 windows: only the mean over the
    # 8 x 16 token losses is taken in another order (two ranks' means of 64, then their mean). Later steps differ by
    # the gradients' reduction order, which AdamW amplifies by up to lr / eps per unit of gradient difference: with
    # the trainer's eps 1e-8 that bound (adam_step_tolerance) is the trivial 2 * lr per element per step, so the
    # batches above are the exact check instead.
    continued = _losses(tmp_path / "c.json")
    assert len(continued) == 7
    assert abs(continued[0] - whole[5]) <= sum_tolerance(n_terms=8 * 16, magnitude=whole[5]), (continued[0], whole[5])
    run_distributed(_refused, 1, flags=[*resume, "--batch-size", "4"])


def test_train_data_llama_folder_with_its_tokenizer(tmp_path: Path) -> None:
    folder = tiny_llama_folder(tmp_path / "llama")
    data = write_jsonl(tmp_path / "docs.jsonl", 200, seed=3)
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3"]
    flags += ["--plugin", "low_level_zero", "--steps", "20", "--log-every", "100", "--eval-fraction", "0.05"]
    parse_options(flags, world_size=1)
    run_distributed(_train, 1, flags=flags, out=str(tmp_path / "losses.json"))
    losses = _losses(tmp_path / "losses.json")
    assert sum(losses[-3:]) < sum(losses[:3]) - 3 * 0.5, losses  # ln 66 = 4.2 nats at the start


def _evaluate_exactly(rank: int, world_size: int, data: str) -> None:
    """4 evaluation windows over 2 ranks x batch 4: rank 1 has none (it runs one window with weight 0). The result is
    the mean over every target token of the windows, as one process computes them one at a time."""
    options = parse_options(
        [*TINY_GPT, "--data", data, "--eval-fraction", "0.2", "--batch-size", "4"], world_size=world_size
    )
    described = describe_model(options.model_spec)
    assert options.data is not None
    user = open_user_data(options.data, options.model, False, options.seq_len + 1)
    assert user.evaluation is not None
    # the 52 held-out tokens [204, 256) split into windows overlapping by one token: 17 + 17 + 17 + 4
    assert len(user.evaluation) == 4
    model = build_model(described, seed=0)
    result = evaluate(model, user, described, 4, (rank, world_size), torch.device("cpu"), step=7)
    batch = user.evaluation.batch(torch.arange(4))
    with torch.no_grad():
        sums = [float(model(ids, labels=labels)) * int((labels[:, 1:] != -100).sum())
                for ids, labels in zip(batch.input_ids.split(1), batch.labels.split(1), strict=True)]  # fmt: skip
    assert batch.targets() == 51  # every held-out token but the first, once
    expected = sum(sums) / 51
    # float32 means over up to 16 tokens taken in another order (4 rows at once vs 1): a few ulps of a loss near 5.5
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert (result.step, result.windows) == (7, 4)


def test_train_data_evaluation_is_the_mean_over_the_fixed_set(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("abcdefghijklmnopqrstuvwxyz0123456789" * 7 + "?" * 3)  # 255 + EOS: 15 windows of 17, 3 held out
    parse_options([*TINY_GPT, "--data", str(data), "--eval-fraction", "0.2", "--batch-size", "4"], world_size=2)
    run_distributed(_evaluate_exactly, 2, data=str(data))


def _replica_batches(rank: int, world_size: int, flags: list[str]) -> None:
    """tp 2 x dp 2 on 4 ranks: the two tensor-parallel ranks of a replica train on the same windows, the replicas on
    different ones."""
    options = parse_options(flags, world_size=world_size)
    plugin, _ = make_plugin(options)
    loader = open_loader(options, plugin)
    dp_rank, dp_size = loader.dp
    assert dp_size == 2
    first = next(iter(loader)).input_ids
    batches = [torch.empty_like(first) for _ in range(world_size)]
    torch.distributed.all_gather(batches, first)
    dp_ranks = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
    torch.distributed.all_gather(dp_ranks, torch.tensor([dp_rank]))
    for other in range(world_size):  # the same windows exactly when the data-parallel rank is the same
        assert torch.equal(batches[other], first) == (int(dp_ranks[other]) == dp_rank), (other, dp_ranks)


def test_train_data_is_sharded_by_data_parallel_rank_only(tmp_path: Path) -> None:
    data = write_text(tmp_path / "a.txt", 2000)
    flags = ["--model", "llama", "--plugin", "hybrid", "--tp", "2", "--nproc", "4", "--hidden-size", "32"]
    flags += ["--seq-len", "16", "--batch-size", "2", "--data", str(data)]
    parse_options(flags, world_size=4)
    run_distributed(_replica_batches, 4, flags=flags)


def test_train_data_refuses_an_embedded_text_checkpoint_for_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPT trained on the grammar's character ids cannot continue on UTF-8 bytes (another vocabulary): a clear
    error instead of a shape mismatch deep in the checkpoint loader."""
    ckpt = tmp_path / "ckpt"
    run_distributed(_train, 1, flags=[*TINY_GPT, "--steps", "1", "--save", str(ckpt)], out=str(tmp_path / "a.json"))
    flags = [*TINY_GPT, "--data", str(write_text(tmp_path / "a.txt", 2000)), "--steps", "2", "--resume", str(ckpt)]
    with pytest.raises(SystemExit) as caught:  # refused before any process starts, no longer on the ranks
        parse_options(flags, world_size=1)
    assert caught.value.code == 2
    assert "was trained on the embedded text" in capsys.readouterr().err
