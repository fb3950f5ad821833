"""`fp8_recipe` (cx's addition beside ColossalAI's `use_fp8`): every plugin that takes use_fp8 takes the recipe
(TENSORWISE, ROWWISE or BLOCKWISE), checks it when it is built, and hands it to every place use_fp8 converts layers
(its own Linear swap, ShardFormer's TP layers, the MoE experts). Training with BLOCKWISE is
test_plugins_fp8_zero's."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from cx_mesh.fp8 import ScalingRecipe
from cx_mesh.testing import distributed
from cx_plugins import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    TorchFSDPPlugin,
)

BLOCKWISE = ScalingRecipe.BLOCKWISE
_PLUGINS = (LowLevelZeroPlugin, GeminiPlugin, HybridParallelPlugin, MoeHybridParallelPlugin, TorchFSDPPlugin)


def _build(plugin: type, **kwargs: Any) -> Any:
    """`plugin` on one rank (the hybrid plugins need their sizes)."""
    sizes = {"tp_size": 1, "pp_size": 1} if plugin in (HybridParallelPlugin, MoeHybridParallelPlugin) else {}
    if plugin is MoeHybridParallelPlugin:
        sizes["ep_size"] = 1
    return plugin(**sizes, **kwargs)


@distributed(world_size=1)
def test_plugins_fp8_recipe_reaches_every_conversion(rank: int, world_size: int) -> None:
    assert LowLevelZeroPlugin(use_fp8=True, fp8_recipe=BLOCKWISE).options.fp8_recipe is BLOCKWISE
    assert GeminiPlugin(use_fp8=True, fp8_recipe=BLOCKWISE).options.fp8_recipe is BLOCKWISE
    hybrid = HybridParallelPlugin(tp_size=1, pp_size=1, use_fp8=True, fp8_recipe=BLOCKWISE)
    assert hybrid.options.shardformer.fp8_options().recipe is BLOCKWISE  # ShardConfig's and the plain Linears'
    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=1, use_fp8=True, fp8_recipe=BLOCKWISE)
    assert moe.options.shardformer.fp8_options().recipe is BLOCKWISE
    assert moe._moe_fp8.matmul.recipe is BLOCKWISE  # the routed experts' fp8_linear
    assert TorchFSDPPlugin(use_fp8=True, fp8_recipe=BLOCKWISE).options.fp8_recipe is BLOCKWISE  # cx_mesh's on CPU
    assert LowLevelZeroPlugin(use_fp8=True).options.fp8_recipe is ScalingRecipe.TENSORWISE  # the default


@distributed(world_size=1)
def test_plugins_fp8_fsdp_refuses_other_recipes_for_torchaos_linears(rank: int, world_size: int) -> None:
    """On CUDA TorchFSDPPlugin's use_fp8 is torchao's Float8Linear, configured TENSORWISE only: another recipe is
    refused when the plugin is built (stood in for here by making the device choice say torchao)."""
    with (
        mock.patch("cx_plugins.fsdp._options.fp8_linears_for_device", return_value="torchao"),
        mock.patch("cx_plugins.fsdp._options.require_torchao"),
        pytest.raises(NotImplementedError, match=r"TorchFSDPPlugin\(fp8_recipe=BLOCKWISE\): on CUDA"),
    ):
        TorchFSDPPlugin(use_fp8=True, fp8_recipe=BLOCKWISE)


@distributed(world_size=1)
@pytest.mark.parametrize("plugin", _PLUGINS, ids=lambda p: p.__name__)
def test_plugins_fp8_recipe_is_checked_when_the_plugin_is_built(rank: int, world_size: int, plugin: type) -> None:
    """A ScalingRecipe, and a non-default one only with use_fp8=True (it would change nothing, silently)."""
    name = plugin.__name__
    with pytest.raises(TypeError, match=rf"{name}: fp8_recipe must be a cx_mesh.fp8.ScalingRecipe"):
        _build(plugin, use_fp8=True, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match=rf"{name}\(fp8_recipe=BLOCKWISE\) takes effect only with use_fp8=True"):
        _build(plugin, fp8_recipe=BLOCKWISE)
