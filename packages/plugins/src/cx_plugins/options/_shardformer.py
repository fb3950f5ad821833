"""`ShardFormerOptions`: the ShardFormer switches of ColossalAI's Gemini, Hybrid and MoE-hybrid plugins, as one group.

The plugins take these as flat keyword arguments (ColossalAI's names); each turns them into this frozen dataclass once
and hands it on whole. `shard_config(...)` builds cx-shardformer's `ShardConfig` from it and the layout's groups, so
no plugin retypes the list.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from cx_mesh import ProcessGroup
from cx_mesh.fp8 import Fp8Options, ScalingRecipe
from cx_shardformer import GradientCheckpointConfig, ShardConfig

__all__ = ["ShardFormerOptions"]


@dataclass(frozen=True)
class ShardFormerOptions:
    """What ShardFormer does to the model besides splitting weights over the tensor-parallel group."""

    enable_all_optimization: bool = False
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    enable_sequence_overlap: bool = False
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    gradient_checkpoint_config: GradientCheckpointConfig | None = None
    use_fp8: bool = False  # the TP layers' matmuls in fp8 (ShardConfig.use_fp8)
    fp8_communication: bool = False  # the TP / SP collectives in fp8 (ShardConfig.fp8_communication)
    fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE  # how use_fp8 scales (ShardConfig.fp8_options.recipe)

    def fp8_options(self) -> Fp8Options:
        """use_fp8's layer filter with this recipe: the TP layers' (ShardConfig) and the plain Linears' swap."""
        return Fp8Options(recipe=self.fp8_recipe)

    def switched_on(self) -> list[str]:
        """The `enable_*` switches that are True (for a plugin's "has no effect here" warning)."""
        return [f.name for f in fields(self) if f.name.startswith("enable_") and getattr(self, f.name)]

    def shard_config(
        self,
        tp_group: ProcessGroup | None,
        sp_group: ProcessGroup | None = None,
        *,
        enable_tensor_parallelism: bool = True,
        ep_group: ProcessGroup | None = None,
        moe_dp_group: ProcessGroup | None = None,
    ) -> ShardConfig:
        """cx-shardformer's ShardConfig for these switches over the given groups (it validates the combination).
        use_fp8 and fp8_communication reach it only where ShardFormer has something to act on (TP layers; TP or SP
        collectives): elsewhere the plugin honours them itself (convert_to_fp8, its p2p and gradient collectives)."""
        tp, sp = enable_tensor_parallelism, self.enable_sequence_parallelism
        return ShardConfig(
            tensor_parallel_process_group=tp_group,
            sequence_parallel_process_group=sp_group,
            enable_tensor_parallelism=enable_tensor_parallelism,
            enable_all_optimization=self.enable_all_optimization,
            enable_fused_normalization=self.enable_fused_normalization,
            enable_flash_attention=self.enable_flash_attention,
            enable_jit_fused=self.enable_jit_fused,
            enable_sequence_parallelism=self.enable_sequence_parallelism,
            sequence_parallelism_mode=self.sequence_parallelism_mode,
            enable_sequence_overlap=self.enable_sequence_overlap,
            parallel_output=self.parallel_output,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            gradient_checkpoint_config=self.gradient_checkpoint_config,
            use_fp8=self.use_fp8 and tp,
            fp8_options=self.fp8_options(),
            fp8_communication=self.fp8_communication and (tp or sp),
            ep_group=ep_group,
            moe_dp_group=moe_dp_group,
        )
