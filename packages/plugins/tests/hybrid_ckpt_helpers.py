"""A test-local hybrid-parallel composition with the checkpoint faces of the issue-15 contract: a tiny transformers
model sharded by cx_shardformer over the TP group of a ParallelLayout, split by cx_pipeline over its PP group, and
trained with a torch optimizer or a LowLevelZeroOptimizer (over the DP group) behind the by-name optimizer face."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, tiny_model_adam_tolerance
from cx_pipeline import (
    GPT2Splitter,
    HFDecoderSplitter,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineModel,
    PipelineStageManager,
    split_model,
)
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.checkpoint_io._stage_names import persistent_buffers
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_shardformer import ShardConfig, ShardFormer, get_shard_spec, unshard_tensor
from cx_zero import LowLevelZeroOptimizer

VOCAB, BATCH, SEQ, LR = 50, 4, 8, 1e-2
# AdamW at TEST_ADAM_EPS: each step is a smooth function of the gradient, so layouts differ by rounding alone (at the
# default eps a near-zero gradient's rounding decides the sign of an lr-sized step); bounded for the tests' 4 steps
RTOL, ATOL = 0.0, tiny_model_adam_tolerance(LR, steps=4, tokens=BATCH * SEQ)


def build(kind: str, seed: int = 0) -> Any:
    """A tiny model: "gpt2", "llama" (2 layers) or "llama4" (4 layers, for two chunks per pipeline stage)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        gpt2 = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(gpt2)
    else:
        llama = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4 if kind == "llama4" else 2,
            num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(llama)
    model.config.use_cache = False
    return model


def batches(steps: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=generator)


class StagedModel(nn.Module):
    """The `ParallelModelView` face over ShardFormer + a cx_pipeline split (what HybridParallelModule offers)."""

    def __init__(self, hf: nn.Module, layout: ParallelLayout, kind: str) -> None:
        super().__init__()
        self.module = hf
        self.layout = layout
        self.pipeline: PipelineModel | None = None
        self.schedule: OneForwardOneBackwardSchedule | InterleavedSchedule | None = None
        if layout.size(Axis.TP) > 1:
            ShardFormer(ShardConfig(tensor_parallel_process_group=layout.group(Axis.TP))).optimize(hf)
        if layout.size(Axis.PP) > 1:
            chunks = 2 if kind == "llama4" else 1  # interleaved: each rank holds two non-adjacent chunks
            manager = PipelineStageManager(
                layout.mesh, Axis.PP.value, enable_interleave=chunks > 1, num_model_chunks=chunks
            )
            splitter = GPT2Splitter(hf) if kind == "gpt2" else HFDecoderSplitter(hf)
            self.pipeline = split_model(splitter, manager)
            self.schedule = (
                InterleavedSchedule(manager, num_model_chunks=chunks, num_microbatch=2)
                if chunks > 1
                else OneForwardOneBackwardSchedule(manager, num_microbatches=2)
            )
        held = list(self.pipeline.parameters()) if self.pipeline is not None else list(hf.parameters())
        ids = {id(p) for p in held}
        self._held = frozenset(n for n, p in hf.named_parameters() if id(p) in ids)
        buffers = {id(b) for b in (self.pipeline.buffers() if self.pipeline is not None else hf.buffers())}
        self._held_buffers = frozenset(n for n, b in persistent_buffers(hf) if id(b) in buffers)

    def unwrap(self) -> nn.Module:
        return self.module

    def held_parameter_names(self) -> frozenset[str]:
        return self._held

    def held_buffer_names(self) -> frozenset[str]:
        return self._held_buffers

    def held_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.module.named_parameters() if n in self._held]

    def loss_and_backward(self, batch: torch.Tensor, face: Any) -> None:
        if self.pipeline is None:
            loss = self.module(input_ids=batch, labels=batch).loss
            face.backward(loss)
            return
        assert self.schedule is not None
        self.schedule.forward_backward_step(
            self.pipeline, iter([{"input_ids": batch, "labels": batch}]), lambda out, _: out.loss, return_loss=True
        )  # the schedule also sums the tied parameters' gradients over their stages


class TorchFace:
    """A torch AdamW over this stage's parameters, state by parameter name (the zero_stage 0 face)."""

    def __init__(self, view: StagedModel) -> None:
        named = [(n, p) for n, p in view.module.named_parameters() if n in view.held_parameter_names()]
        self.names = [n for n, _ in named]
        self.optim = torch.optim.AdamW([p for _, p in named], lr=LR, eps=TEST_ADAM_EPS)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optim.step()
        self.optim.zero_grad()

    def state_dict_by_name(self) -> dict[str, Any]:
        sd = self.optim.state_dict()
        group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
        return {
            "state": {self.names[i]: dict(v) for i, v in sd["state"].items()},
            "param_groups": [{**group, "params": list(self.names)}],
        }

    def load_state_dict_by_name(self, state_dict: Mapping[str, Any]) -> None:
        position = {n: i for i, n in enumerate(self.names)}
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        assert sorted(state_dict["param_groups"][0]["params"]) == sorted(self.names)
        state = {
            position[n]: {k: v for k, v in entries.items() if k != "master_weight"}
            for n, entries in state_dict["state"].items()
        }
        self.optim.load_state_dict(
            {"state": state, "param_groups": [{**group, "params": list(range(len(self.names)))}]}
        )


class ZeroFace:
    """LowLevelZeroOptimizer (ZeRO-2) over the DP group: its `state_dict()` is already by name."""

    def __init__(self, view: StagedModel) -> None:
        layout = view.layout
        self.zero = LowLevelZeroOptimizer(
            torch.optim.AdamW(view.held_parameters(), lr=LR, eps=TEST_ADAM_EPS),
            partition_grad=True,
            dp_process_group=layout.group(Axis.DP),
            module=view.module,
        )

    def backward(self, loss: torch.Tensor) -> None:
        self.zero.backward(loss)

    def step(self) -> None:
        self.zero.step()
        self.zero.zero_grad()

    def state_dict_by_name(self) -> dict[str, Any]:
        return self.zero.state_dict()

    def load_state_dict_by_name(self, state_dict: Mapping[str, Any]) -> None:
        self.zero.load_state_dict(state_dict)


def compose(kind: str, tp: int, pp: int, optimizer: str, seed: int = 0) -> tuple[StagedModel, Any, HybridCheckpointIO]:
    layout = ParallelLayout.build([(Axis.DP, FILL), (Axis.PP, pp), (Axis.TP, tp)], data_axes=(Axis.DP,))
    view = StagedModel(build(kind, seed), layout, kind)
    face: Any = ZeroFace(view) if optimizer == "zero" else TorchFace(view)

    def after_load(loaded: ParallelModelView) -> None:
        if isinstance(face, ZeroFace):
            face.zero.update_master_params(loaded.unwrap())

    def parts_of(opt: object) -> tuple[ParallelModelView, ParallelOptimizerView] | None:
        return (view, cast(ParallelOptimizerView, face)) if opt is face else None

    io = HybridCheckpointIO(parts_of, after_model_load=after_load)
    return view, face, io


def train(view: StagedModel, face: Any, steps: torch.Tensor) -> None:
    dp_rank, dp_size = view.layout.data_rank_and_size()
    per_rank = BATCH // dp_size
    for batch in steps:
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        view.loss_and_backward(mine, face)
        if view.pipeline is not None and isinstance(face, ZeroFace):
            raise AssertionError("the pipeline cases use the torch face")
        face.step()


def reference(kind: str, steps: torch.Tensor) -> nn.Module:
    return reference_with_optimizer(kind, steps)[0]


def reference_with_optimizer(kind: str, steps: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The uninterrupted single-process run (AdamW built from named parameters, so its state is by name)."""
    model = build(kind)
    optim = torch.optim.AdamW(model.named_parameters(), lr=LR, eps=TEST_ADAM_EPS)
    for batch in steps:
        model(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def assert_same_state(actual: torch.optim.Optimizer, expected: torch.optim.Optimizer, what: str) -> None:
    """AdamW's moments by parameter name (Adam's update hides a wrong gradient scale: its moments do not)."""
    mine, theirs = actual.state_dict(), expected.state_dict()
    names = mine["param_groups"][0]["param_names"]
    assert names == theirs["param_groups"][0]["param_names"], what
    assert len(mine["state"]) == len(names), what
    for position, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                mine["state"][position][key], theirs["state"][position][key], rtol=RTOL, atol=1e-7,
                msg=f"{what}: {name}.{key}",
            )  # fmt: skip


def full_params(view: StagedModel) -> dict[str, torch.Tensor]:
    """This stage's parameters as full tensors (TP gathers: every TP rank calls it)."""
    out = {}
    group = view.layout.group_or_none(Axis.TP)
    for name, param in view.module.named_parameters():
        if name in view.held_parameter_names():
            spec = get_shard_spec(param)
            out[name] = param.detach().clone() if spec is None else unshard_tensor(param.detach(), spec, group)
    return out


def assert_matches(actual: Mapping[str, torch.Tensor], expected: nn.Module, what: str) -> None:
    reference_params = dict(expected.named_parameters())
    assert actual, what
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor, reference_params[name].detach(), rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def as_optimizer(face: Any) -> torch.optim.Optimizer:
    return cast(torch.optim.Optimizer, face)


def paths(directory: str, shard: bool) -> tuple[Path, Path]:
    if shard:
        return Path(directory, "model"), Path(directory, "optimizer")
    return Path(directory, "single", "model.safetensors"), Path(directory, "single", "optimizer.safetensors")
