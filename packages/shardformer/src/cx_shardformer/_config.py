"""`ShardConfig` (ColossalAI's field names) and `GradientCheckpointConfig`: what ShardFormer should do to a model.

Strings at the public edge (`sequence_parallelism_mode`) become `SequenceParallelMode` inside. The dataclass is
frozen; `__post_init__` normalises the derived fields once (the default SP mode, what `enable_all_optimization`
switches on) and rejects what cx does not implement, with a message saying so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from cx_mesh import ProcessGroup
from cx_mesh.fp8 import Fp8Options

__all__ = ["GradientCheckpointConfig", "SequenceParallelMode", "ShardConfig"]


class SequenceParallelMode(enum.Enum):
    """The three sequence-parallel modes: Megatron's split/gather on the TP group, Ulysses all-to-all and ring
    attention on the SP group."""

    SPLIT_GATHER = "split_gather"
    ALL_TO_ALL = "all_to_all"
    RING = "ring"


@dataclass(frozen=True)
class GradientCheckpointConfig:
    """Activation checkpointing of the first `gradient_checkpointing_ratio` of a model's decoder layers."""

    gradient_checkpointing_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gradient_checkpointing_ratio <= 1.0:
            raise ValueError(
                f"gradient_checkpointing_ratio must be within [0, 1], got {self.gradient_checkpointing_ratio}"
            )

    def get_num_ckpt_layers(self, num_layers: int) -> int:
        """How many of `num_layers` layers are checkpointed."""
        return int(self.gradient_checkpointing_ratio * num_layers)


@dataclass(frozen=True)
class ShardConfig:
    """ColossalAI's ShardConfig. Process groups default to the whole world; sizes are read from the groups."""

    tensor_parallel_process_group: ProcessGroup | None = None
    sequence_parallel_process_group: ProcessGroup | None = None
    pipeline_stage_manager: Any = None
    enable_tensor_parallelism: bool = True
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
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    ep_group: ProcessGroup | None = None
    moe_dp_group: ProcessGroup | None = None
    fp8_communication: bool = False  # TP/SP collectives in fp8 (cx_mesh.fp8: E4M3 forward, E5M2 gradients)
    use_fp8: bool = False  # TP layers' matmuls in fp8 (ColossalAI passes it beside ShardConfig; one group in cx)
    fp8_options: Fp8Options = field(default_factory=Fp8Options)  # which layers use_fp8 converts, and the recipe

    def __post_init__(self) -> None:
        if self.pipeline_stage_manager is not None:
            raise NotImplementedError(
                "ShardConfig: pipeline_stage_manager is not supported by cx-shardformer yet (pipeline stages are "
                "split by cx-pipeline); pass None"
            )
        if self.extra_kwargs:
            raise NotImplementedError(
                f"ShardConfig: extra_kwargs {sorted(self.extra_kwargs)} are not used by any cx-shardformer policy"
            )
        self._check_fp8()
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(
                f"ShardConfig: make_vocab_size_divisible_by must be >= 1, got {self.make_vocab_size_divisible_by}"
            )
        if self.enable_all_optimization:
            # as ColossalAI; sequence overlap follows below, where split_gather is on
            object.__setattr__(self, "enable_fused_normalization", True)
            object.__setattr__(self, "enable_jit_fused", True)
            object.__setattr__(self, "enable_flash_attention", True)
        if self.enable_sequence_parallelism:
            mode = self.sequence_parallelism_mode or SequenceParallelMode.SPLIT_GATHER.value
            known = [m.value for m in SequenceParallelMode]
            if mode not in known:
                raise ValueError(f"ShardConfig: sequence_parallelism_mode {mode!r} is not one of {known}")
            object.__setattr__(self, "sequence_parallelism_mode", mode)
            if mode == SequenceParallelMode.SPLIT_GATHER.value and not self.enable_tensor_parallelism:
                raise ValueError(
                    "ShardConfig: sequence_parallelism_mode 'split_gather' runs on the tensor-parallel group and "
                    "needs enable_tensor_parallelism=True"
                )
        elif self.sequence_parallelism_mode is not None:
            raise ValueError(
                f"ShardConfig: sequence_parallelism_mode={self.sequence_parallelism_mode!r} given but "
                "enable_sequence_parallelism is False"
            )
        self._check_sequence_overlap()

    def _check_sequence_overlap(self) -> None:
        """enable_sequence_overlap rings split_gather's all-gather / reduce-scatter with the matmuls: with any other
        sequence mode (or none) it has nothing to overlap and raises; with use_fp8 / fp8_communication the ring
        computes and sends in fp8 (`_overlap`); enable_all_optimization turns it on exactly where split_gather is on."""
        split_gather = self.sp_mode is SequenceParallelMode.SPLIT_GATHER
        if self.enable_all_optimization and split_gather:
            object.__setattr__(self, "enable_sequence_overlap", True)
        if self.enable_sequence_overlap and not split_gather:
            mode = self.sequence_parallelism_mode if self.enable_sequence_parallelism else "off"
            raise ValueError(
                "ShardConfig: enable_sequence_overlap overlaps split_gather sequence parallelism's all-gather and "
                f"reduce-scatter with the matmuls; sequence parallelism is {mode!r} here: turn on "
                "enable_sequence_parallelism with sequence_parallelism_mode='split_gather', or leave the switch off"
            )

    def _check_fp8(self) -> None:
        """use_fp8 acts on the tensor-parallel layers and fp8_communication on the TP / SP collectives: with neither
        there, the switch would change nothing, so it raises."""
        if not isinstance(self.fp8_options, Fp8Options):
            raise TypeError(f"ShardConfig: fp8_options must be a cx_mesh.fp8.Fp8Options, got {self.fp8_options!r}")
        if self.use_fp8 and not self.enable_tensor_parallelism:
            raise ValueError(
                "ShardConfig: use_fp8=True runs the tensor-parallel layers' matmuls in fp8 and "
                "enable_tensor_parallelism is False, so there are none; plain nn.Linear layers convert with "
                "cx_mesh.fp8.convert_to_fp8"
            )
        if self.fp8_communication and not (self.enable_tensor_parallelism or self.enable_sequence_parallelism):
            raise ValueError(
                "ShardConfig: fp8_communication=True compresses the tensor- and sequence-parallel collectives and "
                "both enable_tensor_parallelism and enable_sequence_parallelism are False, so there are none"
            )

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks in the tensor-parallel group (1 when tensor parallelism is off)."""
        if not self.enable_tensor_parallelism:
            return 1
        return int(dist.get_world_size(self.tensor_parallel_process_group))

    @property
    def tensor_parallel_rank(self) -> int:
        return int(dist.get_rank(self.tensor_parallel_process_group)) if self.enable_tensor_parallelism else 0

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks in the sequence-parallel group (1 when sequence parallelism is off)."""
        if not self.enable_sequence_parallelism:
            return 1
        return int(dist.get_world_size(self.sp_group))

    @property
    def sp_mode(self) -> SequenceParallelMode | None:
        """The sequence-parallel mode as an enum, None when off."""
        if not self.enable_sequence_parallelism or self.sequence_parallelism_mode is None:
            return None
        return SequenceParallelMode(self.sequence_parallelism_mode)

    @property
    def sp_group(self) -> ProcessGroup | None:
        """Split/gather runs on the tensor-parallel group; all-to-all and ring on the sequence-parallel group."""
        if self.sp_mode is SequenceParallelMode.SPLIT_GATHER:
            return self.tensor_parallel_process_group
        return self.sequence_parallel_process_group
