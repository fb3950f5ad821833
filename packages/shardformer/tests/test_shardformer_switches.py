"""ShardConfig's switches do what they say on a tp-2 Llama, and results still equal the unsharded model's:
enable_flash_attention selects torch SDPA, enable_fused_normalization swaps transformers' RMSNorm for torch's
nn.RMSNorm (same Parameters), gradient_checkpoint_config checkpoints the first ratio of the decoder layers (their
forward runs again in backward). Unimplemented switches raise. Skips without transformers."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from cx_mesh.testing import distributed
from cx_shardformer import GradientCheckpointConfig, ShardConfig, ShardFormer
from shardformer_helpers import assert_close
from shardformer_models import build, compare_grads, tokens, twin

pytest.importorskip("transformers")


def _run_and_compare(model: nn.Module, reference: nn.Module, what: str) -> None:
    ids = tokens(1)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
    assert_close(out.loss, ref_out.loss.detach(), f"{what} loss")
    out.loss.backward()
    ref_out.loss.backward()
    compare_grads(model, reference, what)


@distributed(world_size=2)
def test_shardformer_flash_attention_and_fused_norm(rank: int, world_size: int) -> None:
    model: Any = build("llama", attn_implementation="eager")
    reference = twin(model)
    norms = {name: m.weight for name, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    assert len(norms) == 5
    config = ShardConfig(enable_all_optimization=True)
    assert config.enable_flash_attention
    assert config.enable_fused_normalization
    model, _ = ShardFormer(config).optimize(model)
    assert model.config._attn_implementation == "sdpa"
    modules = dict(model.named_modules())
    for name, weight in norms.items():
        assert isinstance(modules[name], nn.RMSNorm), f"{name} was not fused"
        assert modules[name].weight is weight
    _run_and_compare(model, reference, "sdpa + fused RMSNorm")


@distributed(world_size=2)
@pytest.mark.parametrize(("ratio", "checkpointed"), [(0.5, 1), (1.0, 2)])
def test_shardformer_gradient_checkpointing_ratio(rank: int, world_size: int, ratio: float, checkpointed: int) -> None:
    model: Any = build("llama")
    reference = twin(model)
    config = ShardConfig(gradient_checkpoint_config=GradientCheckpointConfig(gradient_checkpointing_ratio=ratio))
    model, _ = ShardFormer(config).optimize(model)
    layers = model.model.layers
    assert [bool(layer.gradient_checkpointing) for layer in layers] == [i < checkpointed for i in range(2)]
    calls = [0, 0]
    for index, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    model.train()
    _run_and_compare(model, reference, f"checkpointing ratio {ratio}")
    assert calls == [2 if i < checkpointed else 1 for i in range(2)], "checkpointed layers recompute in backward"


def test_shardformer_config_rejects_what_it_cannot_do() -> None:
    with pytest.raises(NotImplementedError, match="pipeline_stage_manager"):
        ShardConfig(pipeline_stage_manager=object())
    with pytest.raises(NotImplementedError, match="extra_kwargs \\['x'\\]"):
        ShardConfig(extra_kwargs={"x": 1})
    with pytest.raises(ValueError, match="not one of"):
        ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="zigzag")
    with pytest.raises(ValueError, match="enable_sequence_parallelism is False"):
        ShardConfig(sequence_parallelism_mode="ring")
    with pytest.raises(ValueError, match="needs enable_tensor_parallelism"):
        ShardConfig(enable_tensor_parallelism=False, enable_sequence_parallelism=True)
    with pytest.raises(ValueError, match="within"):
        GradientCheckpointConfig(gradient_checkpointing_ratio=1.5)
    config = ShardConfig(enable_sequence_parallelism=True)
    assert config.sequence_parallelism_mode == "split_gather"
    with pytest.raises(AttributeError):
        config.parallel_output = False  # type: ignore[misc]
