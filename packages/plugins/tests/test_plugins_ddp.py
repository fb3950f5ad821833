"""TorchDDPPlugin through the Booster against single-process PyTorch: same seed, same data, several steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh import RankMismatchError
from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_plugins import Booster, TorchDDPPlugin
from cx_plugins.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=128, max_positions=16, hidden_size=32, num_layers=2, num_heads=4)
STEPS = 5
PER_RANK_BATCH = 2
LENGTH = 16
LR = 1e-3

# The reference replays data parallelism in one process: each rank's micro-batch runs forward/backward separately
# (under the same autocast) and the fp32 gradients are averaged, exactly what DDP computes. So every precision can be
# held to fp32-level tolerances: only the all-reduce's summation order differs. AdamW at TEST_ADAM_EPS keeps each
# step a smooth function of the gradient (at the default eps a near-zero gradient's rounding decides the sign of an
# lr-sized step), so the parameters differ by rounding alone (bounded from it below), while a real error (a missing,
# doubled or mis-scaled reduction) moves elements by ~lr.
PARAM_RTOL, PARAM_ATOL = 1e-5, tiny_model_adam_tolerance(LR, STEPS, tokens=2 * PER_RANK_BATCH * LENGTH)
LOSS_RTOL = 1e-5
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(world_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, world_size * PER_RANK_BATCH, LENGTH), generator=generator)


def _reference_run(
    data: torch.Tensor, precision: str, world_size: int
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = GPT(CONFIG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    losses, snapshots = [], []
    for batch in data:
        total = 0.0
        for micro in batch.split(PER_RANK_BATCH):
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(micro, labels=micro) / world_size
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.item()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, snapshots


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_plugins_ddp_matches_single_process(rank: int, world_size: int, precision: str) -> None:
    if world_size == 4 and precision != "fp32":
        pytest.skip("low precision is covered at world sizes 1 and 2; 4 ranks add nothing but time")
    data = _batches(world_size)
    ref_losses, ref_snapshots = _reference_run(data, precision, world_size)

    booster = Booster(mixed_precision=None if precision == "fp32" else precision, plugin=TorchDDPPlugin())
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    for step, batch in enumerate(data):
        loss = model(batch[mine], labels=batch[mine])
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world_size
        assert mean_loss.item() == pytest.approx(ref_losses[step], rel=LOSS_RTOL), f"step {step}"
        for name, value in plain.state_dict().items():
            try:
                torch.testing.assert_close(value, ref_snapshots[step][name], rtol=PARAM_RTOL, atol=PARAM_ATOL)
            except AssertionError as error:
                raise AssertionError(f"step {step}, {name}: {error}") from None


@distributed(world_size=2)
def test_plugins_ddp_no_sync_accumulation_equals_large_batch(rank: int, world_size: int) -> None:
    micro_steps = 2
    generator = torch.Generator().manual_seed(7)
    data = torch.randint(0, CONFIG.vocab_size, (micro_steps, world_size * PER_RANK_BATCH, LENGTH), generator=generator)
    reference = GPT(CONFIG, seed=0)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in data:
        (reference(batch, labels=batch) / micro_steps).backward()
    ref_optimizer.step()

    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    assert optimizer is not None
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    with booster.no_sync(model, optimizer):
        booster.backward(model(data[0][mine], labels=data[0][mine]) / micro_steps, optimizer)
    booster.backward(model(data[1][mine], labels=data[1][mine]) / micro_steps, optimizer)
    optimizer.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)


@distributed(world_size=2)
def test_plugins_prepare_dataloader_disjoint_and_deterministic(rank: int, world_size: int) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    plugin = TorchDDPPlugin()

    def indices() -> list[int]:
        loader = plugin.prepare_dataloader(dataset, batch_size=3, shuffle=True, seed=5)
        return [int(i) for (batch,) in loader for i in batch]

    mine = indices()
    assert mine == indices(), "same seed must give the same order"
    tensor = torch.tensor(mine)
    everyone = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(everyone, tensor)
    union = [int(i) for t in everyone for i in t]
    assert sorted(union) == list(range(20)), "ranks together cover the dataset exactly once"


@distributed(world_size=2)
def test_plugins_bad_input_is_reported(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"unsupported precision 'fp8'; accepted: 'fp32', 'fp16', 'bf16'"):
        Booster(mixed_precision="fp8", plugin=TorchDDPPlugin())
    with pytest.raises(ValueError, match="needs a plugin"):
        Booster()
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        TorchDDPPlugin(bucket_cap_mb=0)
    with pytest.raises(RankMismatchError, match="ranks disagree on TorchDDPPlugin options"):
        TorchDDPPlugin(fp8_communication=rank == 1)  # fp8 on one rank only would hang in mismatched collectives
    with pytest.raises(RankMismatchError, match="ranks disagree on TorchDDPPlugin options"):
        TorchDDPPlugin(static_graph=rank == 1)
    with pytest.raises(NotImplementedError, match="needs a plugin with pipeline parallelism"):
        Booster(plugin=TorchDDPPlugin()).execute_pipeline(iter([]), torch.nn.Linear(1, 1), None)
