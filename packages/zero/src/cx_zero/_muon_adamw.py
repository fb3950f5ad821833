"""`MuonWithAdamW`: Muon's usual recipe in one optimizer object (one Booster optimizer, one state dict).

Muon orthogonalises the update of hidden 2-D matrices; 1-D parameters (norms, biases), embeddings and the output
head follow AdamW (Keller Jordan's post, torch.optim.Muon's own docs). Each param group carries `use_muon`: True
steps it with torch's Muon math (`torch.optim._muon.muon`, the function `torch.optim.Muon.step` calls), False with
torch's AdamW math (`torch.optim.adamw.adamw`, as `torch.optim.AdamW.step` calls it), so each group's update is
bit-identical to the torch optimizer of its kind. `muon_param_groups` sorts a model's parameters by that rule; a user
may pass their own groups instead. A 3-D parameter in a Muon group is a stack of matrices (an MoE layer's fused
experts, (experts, out, in)): each expert's matrix is orthogonalised on its own (`_muon_stacks`), bit-identical to
torch's Muon on that matrix alone.

The state is a plain optimizer state dict: Muon groups hold `momentum_buffer`, AdamW groups `step`, `exp_avg`,
`exp_avg_sq` (the torch optimizers' own names), and each group's hyperparameters are plain values, so checkpoints
need no pickled code. Muon needs each matrix whole, so the class is whole-tensor (`cx_zero._elementwise`), but its
AdamW groups are elementwise and it says so per group (`param_group_is_elementwise`, the `GroupKinds` protocol):
LowLevelZero steps those on its flat shards (each rank 1/dp of their masters and moments, as for a plain AdamW) and
only the Muon groups whole on one owner rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim._muon import muon as _muon_update
from torch.optim.adamw import adamw as _adamw_update

from cx_zero._muon_stacks import muon_stacks

__all__ = ["MUON_DEFAULTS", "MuonUpdate", "MuonWithAdamW", "muon_param_groups"]

# a Muon group's update: (params, grads, momentum buffers, *, lr, weight_decay, momentum, nesterov, ns_coefficients,
# ns_steps, eps, adjust_lr_fn[, has_complex]): torch's Muon function for 2-D matrices, `muon_stacks` for 3-D stacks
MuonUpdate = Callable[..., None]

# torch.optim.Muon's defaults (its Newton-Schulz coefficients are Keller Jordan's)
MUON_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "foreach")


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the param groups flagged `use_muon=True` (2-D matrices, and 3-D stacks of them such as fused experts:
    each matrix orthogonalised on its own), AdamW on the others.

    Keyword defaults fill what a group leaves out: `lr`, `weight_decay`, `momentum`, `nesterov`, `ns_coefficients`,
    `eps`, `ns_steps`, `adjust_lr_fn` (torch.optim.Muon's) for Muon groups; `adamw_lr` (default `lr`),
    `adamw_betas`, `adamw_eps`, `adamw_weight_decay` (default 0.01, AdamW's) for AdamW groups, which hold them
    under AdamW's names (`lr`, `betas`, `eps`, `weight_decay`), so an LR scheduler scales both kinds."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = MUON_DEFAULTS["lr"],
        weight_decay: float = MUON_DEFAULTS["weight_decay"],
        momentum: float = MUON_DEFAULTS["momentum"],
        nesterov: bool = MUON_DEFAULTS["nesterov"],
        ns_coefficients: tuple[float, float, float] = MUON_DEFAULTS["ns_coefficients"],
        eps: float = MUON_DEFAULTS["eps"],
        ns_steps: int = MUON_DEFAULTS["ns_steps"],
        adjust_lr_fn: str | None = MUON_DEFAULTS["adjust_lr_fn"],
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        groups = list(params)
        if not groups or not all(isinstance(group, dict) for group in groups):
            raise TypeError(
                "MuonWithAdamW takes param groups (dicts) each flagged use_muon=True (2-D hidden matrices: Muon) or "
                "False (AdamW); cx_zero.muon_param_groups(model) builds them"
            )
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"MuonWithAdamW: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
            )
        self._kind_defaults: dict[bool, dict[str, Any]] = {
            True: {
                "lr": lr,
                "weight_decay": weight_decay,
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_coefficients": tuple(ns_coefficients),
                "eps": eps,
                "ns_steps": ns_steps,
                "adjust_lr_fn": adjust_lr_fn,
            },
            False: {
                "lr": lr if adamw_lr is None else adamw_lr,
                "betas": tuple(adamw_betas),
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
                "foreach": None,  # as AdamW: foreach where torch picks it (CUDA), single-tensor otherwise
            },
        }
        super().__init__(groups, {})
        # what the Muon groups step with; a plugin that holds the matrices sharded (TorchFSDPPlugin) puts its own
        # here for the duration of a step (Newton-Schulz on whole matrices at owner ranks): plain attributes, so the
        # state dict and the math stay the optimizer's own
        self.matrix_update: MuonUpdate = _muon_update
        self.stack_update: MuonUpdate = muon_stacks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group must say `use_muon`; its kind's defaults fill the rest; a Muon group takes 2-D matrices and 3-D
        stacks of matrices only."""
        use_muon = param_group.get("use_muon")
        if not isinstance(use_muon, bool):
            raise ValueError(
                f"MuonWithAdamW: every param group needs use_muon=True (Muon) or False (AdamW), got {use_muon!r}"
            )
        kind = self._kind_defaults[use_muon]
        allowed = {"params", "use_muon", "initial_lr", *kind}
        unknown = sorted(set(param_group) - allowed)
        if unknown:
            name = "Muon" if use_muon else "AdamW"
            raise ValueError(
                f"MuonWithAdamW: unknown option(s) {unknown} for a {name} group; allowed: {sorted(allowed)}"
            )
        for key, value in kind.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if use_muon:
            for param in self.param_groups[-1]["params"]:
                if param.ndim not in (2, 3):
                    raise ValueError(
                        f"MuonWithAdamW: a use_muon group holds a parameter of shape {tuple(param.shape)}; Muon steps "
                        f"2-D matrices only (or 3-D stacks of them, each matrix on its own), put it in a "
                        f"use_muon=False (AdamW) group"
                    )

    def param_group_is_elementwise(self, group: Mapping[str, Any]) -> bool:
        """Whether `group`'s update is elementwise (an AdamW group: it may step on flat shards); a Muon group needs
        each matrix whole (`cx_zero.elementwise_groups` reads this)."""
        return not group["use_muon"]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group with its kind's torch math."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        """2-D matrices through torch's Muon function, 3-D stacks through `muon_stacks` (same math per matrix)."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        stacks: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse or torch.is_complex(param):
                raise RuntimeError("MuonWithAdamW: Muon takes neither sparse gradients nor complex parameters")
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            into = stacks if param.ndim == 3 else (params, grads, buffers)
            into[0].append(param)
            into[1].append(param.grad)
            into[2].append(state["momentum_buffer"])
        options: dict[str, Any] = {
            "lr": group["lr"],
            "weight_decay": group["weight_decay"],
            "momentum": group["momentum"],
            "nesterov": group["nesterov"],
            "ns_coefficients": tuple(group["ns_coefficients"]),
            "ns_steps": group["ns_steps"],
            "eps": group["eps"],
            "adjust_lr_fn": group["adjust_lr_fn"],
        }
        if params:
            self.matrix_update(params, grads, buffers, has_complex=False, **options)
        if stacks[0]:
            self.stack_update(*stacks, **options)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        has_complex = False
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("MuonWithAdamW: AdamW takes no sparse gradients")
            has_complex |= torch.is_complex(param)
            state = self.state[param]
            if len(state) == 0:  # AdamW's own lazy state (step as a CPU float32 scalar: not capturable, not fused)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        _adamw_update(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            has_complex=has_complex,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def _head_ids(model: nn.Module, head_names: Sequence[str]) -> set[int]:
    """Ids of the output head's parameters: `get_output_embeddings()` (Hugging Face) and modules named in
    `head_names` (last name component)."""
    ids: set[int] = set()
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if isinstance(head, nn.Module):
        ids.update(id(p) for p in head.parameters())
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in head_names:
            ids.update(id(p) for p in module.parameters())
    return ids


def _expert_ids(model: nn.Module, expert_names: Sequence[str]) -> tuple[set[int], set[int]]:
    """Ids of the parameters held directly by modules named in `expert_names` (last name component): the 3-D fused
    expert stacks (transformers' `mlp.experts.gate_up_proj`, (experts, out, in)), and the 2-D per-expert bias stacks
    beside them (gpt-oss' `gate_up_proj_bias`, (experts, out)), which are not matrices."""
    stacks: set[int] = set()
    biases: set[int] = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in expert_names:
            continue
        for param in module.parameters(recurse=False):
            if param.ndim == 3:
                stacks.add(id(param))
            elif param.ndim == 2:
                biases.add(id(param))
    return stacks, biases


def muon_param_groups(
    model: nn.Module,
    *,
    head_names: Sequence[str] = ("lm_head", "output", "classifier"),
    expert_names: Sequence[str] = ("experts",),
) -> list[dict[str, Any]]:
    """`model`'s trainable parameters as MuonWithAdamW groups, by Muon's recipe: 2-D hidden matrices and the 3-D
    expert stacks of modules named in `expert_names` (each expert's matrix orthogonalised on its own) in a
    `use_muon=True` group; 1-D (and other) parameters, the 2-D per-expert bias stacks of those modules,
    `nn.Embedding` weights and the output head (found by `get_output_embeddings()` or a module named in `head_names`;
    a head tied to the embedding is one parameter) in a `use_muon=False` (AdamW) group. Empty groups are left out;
    add hyperparameters to the dicts as needed."""
    adamw_ids = _head_ids(model, head_names)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            adamw_ids.update(id(p) for p in module.parameters(recurse=False))
    stack_ids, bias_ids = _expert_ids(model, expert_names)
    adamw_ids |= bias_ids
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for param in model.parameters():  # shared (tied) parameters once
        if not param.requires_grad:
            continue
        hidden = (param.ndim == 2 and id(param) not in adamw_ids) or id(param) in stack_ids
        (muon if hidden else adamw).append(param)
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": muon, "use_muon": True})
    if adamw:
        groups.append({"params": adamw, "use_muon": False})
    return groups
