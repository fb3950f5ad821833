"""Frozen, validated option sets: how a router scores and picks experts, how experts compute, and the optional
capacity limit. Strings at the public edge ("softmax", "probability", "silu") become enums here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from cx_mesh.fp8 import Fp8Options

__all__ = [
    "Activation",
    "CapacityOptions",
    "DropPolicy",
    "ExpertImplementation",
    "ExpertOptions",
    "MoeFp8Options",
    "RouterOptions",
    "ScoreFunction",
]


class ScoreFunction(Enum):
    """How router logits become scores: softmax over experts (Mixtral, Qwen) or an independent sigmoid per expert
    (DeepSeek-V3)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class DropPolicy(Enum):
    """Which assignments an over-full expert keeps: the highest routing weights, or the earliest tokens."""

    PROBABILITY = "probability"
    POSITION = "position"


class Activation(Enum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"


class ExpertImplementation(Enum):
    """`grouped_mm`: one torch grouped matmul per projection (needs support for the dtype/device/alignment);
    `loop`: one matmul per expert; `auto`: grouped_mm where supported, the loop otherwise."""

    AUTO = "auto"
    GROUPED_MM = "grouped_mm"
    LOOP = "loop"


_E = TypeVar("_E", bound=Enum)


def _enum(kind: type[_E], value: _E | str, name: str) -> _E:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = [m.value for m in kind]
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


@dataclass(frozen=True)
class RouterOptions:
    """Top-k token-choice routing.

    - `score_function`: "softmax" or "sigmoid"; scores are always computed in fp32.
    - `normalize_top_k`: divide the k chosen scores by their sum (Mixtral: yes; Qwen: `norm_topk_prob`).
    - `scaling_factor`: multiplies the final top-k weights (DeepSeek-V3 `routed_scaling_factor`).
    - `jitter_noise`: in training, multiply the router input by U(1 - eps, 1 + eps) (Switch / Mixtral).
    - `aux_loss_coef` / `z_loss_coef`: weights of the load-balancing loss (Switch formula) and the router z-loss
      in `collect_router_losses`; 0 disables a term.
    - `expert_bias`: aux-loss-free balancing: a per-expert bias added to the scores for selection only, updated
      by `update_expert_bias` after the optimizer step with step size `bias_update_rate`.
    - `num_groups` / `top_k_groups`: group-limited routing (experts in `num_groups` equal groups, tokens choose
      among the best `top_k_groups` groups first; DeepSeek-V3). 1 / 1 disables it.
    """

    num_experts: int
    top_k: int
    score_function: ScoreFunction | str = ScoreFunction.SOFTMAX
    normalize_top_k: bool = True
    scaling_factor: float = 1.0
    jitter_noise: float = 0.0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    num_groups: int = 1
    top_k_groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "score_function", _enum(ScoreFunction, self.score_function, "score_function"))
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if not 0.0 <= self.jitter_noise < 1.0:
            raise ValueError(f"jitter_noise must be in [0, 1), got {self.jitter_noise}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if not 1 <= self.top_k_groups <= self.num_groups:
            raise ValueError(f"top_k_groups must be in [1, num_groups={self.num_groups}], got {self.top_k_groups}")
        if self.num_groups > 1 and self.top_k > self.top_k_groups * (self.num_experts // self.num_groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the experts in the top_k_groups={self.top_k_groups} groups a token may "
                f"use ({self.top_k_groups * (self.num_experts // self.num_groups)})"
            )

    @property
    def score(self) -> ScoreFunction:
        assert isinstance(self.score_function, ScoreFunction)
        return self.score_function


@dataclass(frozen=True)
class CapacityOptions:
    """Optional per-expert capacity, for static shapes. Capacity per expert on each rank is
    `max(min_capacity, ceil(capacity_factor * local_tokens * top_k / num_experts))`. Assignments beyond it are
    dropped (their weight is lost; the token keeps only its other experts, and the residual around the layer):
    `drop_policy` "probability" keeps each expert's highest-weight assignments, "position" its earliest tokens (in
    the order of the local batch). With `pad_to_capacity`, every expert receives exactly `capacity` rows per
    sending rank (zeros where unused), so the all-to-all has fixed, equal splits and no count exchange: all ranks
    must then pass the same number of tokens."""

    capacity_factor: float
    drop_policy: DropPolicy | str = DropPolicy.PROBABILITY
    pad_to_capacity: bool = False
    min_capacity: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "drop_policy", _enum(DropPolicy, self.drop_policy, "drop_policy"))
        if not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0, got {self.capacity_factor}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")

    @property
    def policy(self) -> DropPolicy:
        assert isinstance(self.drop_policy, DropPolicy)
        return self.drop_policy


@dataclass(frozen=True)
class ExpertOptions:
    """The routed experts: `gated` SwiGLU-style experts store `gate_up_proj [E, 2I, H]` (gate rows first) and
    `down_proj [E, H, I]` as in transformers 5; plain experts store `up_proj [E, I, H]` and `down_proj`.
    `shared_intermediate_size` > 0 adds an always-on shared expert (DeepSeek, Qwen2-MoE), optionally scaled by a
    sigmoid gate (`shared_expert_gate`, Qwen2-MoE)."""

    hidden_size: int
    intermediate_size: int
    gated: bool = True
    activation: Activation | str = Activation.SILU
    implementation: ExpertImplementation | str = ExpertImplementation.AUTO
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation", _enum(Activation, self.activation, "activation"))
        object.__setattr__(self, "implementation", _enum(ExpertImplementation, self.implementation, "implementation"))
        if self.hidden_size < 1 or self.intermediate_size < 1:
            raise ValueError(
                f"hidden_size and intermediate_size must be >= 1, got {self.hidden_size}, {self.intermediate_size}"
            )
        if self.shared_intermediate_size < 0:
            raise ValueError(f"shared_intermediate_size must be >= 0, got {self.shared_intermediate_size}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")

    @property
    def act(self) -> Activation:
        assert isinstance(self.activation, Activation)
        return self.activation

    @property
    def impl(self) -> ExpertImplementation:
        assert isinstance(self.implementation, ExpertImplementation)
        return self.implementation


@dataclass(frozen=True)
class MoeFp8Options:
    """fp8 in the MoE path (ColossalAI's `use_fp8` / `fp8_communication` for MoE blocks).

    - `use_fp8`: each routed expert's two matmuls run in fp8 with `cx_mesh.fp8.fp8_linear` (E4M3 operands, E5M2
      gradients (E4M3 with BLOCKWISE), dynamic scales with `matmul.recipe`), for the projections whose dims
      `fp8_eligible(..., matmul)` accepts; the others stay in high precision, as torchtitan filters small layers.
      Master weights are unchanged.
    - `fp8_communication`: the dispatch and combine all-to-alls send their rows as fp8 with
      `cx_mesh.fp8.all_to_all_single_fp8` (E4M3 forward, E5M2 for the gradients in backward), one scale per
      destination rank; only meaningful with an expert-parallel group of size > 1 (refused otherwise).
    """

    use_fp8: bool = False
    fp8_communication: bool = False
    matmul: Fp8Options = field(default_factory=Fp8Options)

    def __post_init__(self) -> None:
        if not isinstance(self.matmul, Fp8Options):
            raise TypeError(f"MoeFp8Options.matmul must be a cx_mesh.fp8.Fp8Options, got {self.matmul!r}")

    @property
    def enabled(self) -> bool:
        return self.use_fp8 or self.fp8_communication
