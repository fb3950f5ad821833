"""use_fp8 and checkpoints under LowLevelZeroPlugin (stage 2, 2 ranks, bf16): `Fp8Linear` is a class swap, so a
tiny HF Llama trained with use_fp8 saves exactly the keys a plain one has; its checkpoint loads (strict) into a plain
model, and the plain model's checkpoint loads back into an fp8 one, every value equal to the bit. A Llama built
under `LazyInitContext` boosts with use_fp8: its eligible Linears become Fp8Linear holding the eager model's values,
and it trains. Skipped when transformers is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from cx_mesh.fp8 import Fp8Linear
from cx_mesh.testing import distributed
from cx_plugins import Booster, LazyInitContext, LowLevelZeroPlugin, OptimizerWrapper

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 128, 16
CONVERTED = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head excluded by Fp8Options, the embedding is no Linear


def _llama(lazy: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if not lazy:
        model: nn.Module = transformers.LlamaForCausalLM(config)
        return model
    with LazyInitContext():
        model = transformers.LlamaForCausalLM(config)
    return model


def _boost(model: nn.Module, use_fp8: bool) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="bf16", use_fp8=use_fp8))
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert optimizer is not None
    return booster, boosted, optimizer


def _step(rank: int, booster: Booster, boosted: nn.Module, optimizer: OptimizerWrapper) -> None:
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(rank))
    loss = boosted(input_ids=ids, labels=ids).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _fp8_layers(model: nn.Module) -> int:
    return sum(isinstance(module, Fp8Linear) for module in model.modules())


def _save(booster: Booster, boosted: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    booster.save_model(boosted, path, use_safetensors=True)
    dist.barrier()  # rank 0 writes the file every rank reads
    return load_file(path)


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: other keys {set(actual) ^ set(expected)}"
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{what}: {name} differs"


@distributed(world_size=2)
def test_plugins_fp8_checkpoint_loads_into_plain_models_and_back_and_lazy_init_boosts(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    plain_keys = list(_llama().state_dict())
    booster, boosted, optimizer = _boost(_llama(), use_fp8=True)
    assert _fp8_layers(boosted) == CONVERTED
    _step(rank, booster, boosted, optimizer)
    trained = _save(booster, boosted, tmp_path / "fp8.safetensors")
    assert sorted(trained) == sorted(plain_keys), set(trained) ^ set(plain_keys)  # a file's keys come back sorted

    plain_booster, plain, _ = _boost(_llama(), use_fp8=False)  # at its initial values: loading must change them
    assert _fp8_layers(plain) == 0
    plain_booster.load_model(plain, tmp_path / "fp8.safetensors")
    _assert_same(_save(plain_booster, plain, tmp_path / "plain.safetensors"), trained, "fp8 -> plain")

    back_booster, back, _ = _boost(_llama(), use_fp8=True)
    back_booster.load_model(back, tmp_path / "plain.safetensors")
    assert _fp8_layers(back) == CONVERTED
    _assert_same(_save(back_booster, back, tmp_path / "back.safetensors"), trained, "plain -> fp8")

    eager = {name: tensor.bfloat16() for name, tensor in _llama().state_dict().items()}
    lazy_booster, lazy, lazy_optimizer = _boost(_llama(lazy=True), use_fp8=True)
    assert _fp8_layers(lazy) == CONVERTED
    _assert_same(_save(lazy_booster, lazy, tmp_path / "lazy.safetensors"), eager, "lazy + use_fp8")
    _step(rank, lazy_booster, lazy, lazy_optimizer)
    assert all(bool(p.isfinite().all()) for p in lazy.parameters())
