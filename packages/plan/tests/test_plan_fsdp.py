"""Per-block FSDP in cx-plan: the Candidate's `fsdp_wrap`, its memory arithmetic (the root unit and the two largest
blocks gathered, the root re-gathered when the backward starts, the root's reduce-scatter last), the decoder-layer
wrap policy and the classes it finds, and the ranking's preference for it. cx-train's `--plugin torch_fsdp` sharding
each layer is tested with cx-train (test_train_plan_agreement.py); the measured check (llama dp 2, within 10 %) is a
case of test_plan_memory.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cx_plan import Candidate, build_model, load_model_shape
from cx_plan._report import constructor_call, rank_rows, train_command
from cx_plan.memory._memory import predict_memory_from_traces
from cx_plan.trace._activations import ActivationTrace
from cx_plan.trace._model_spec import ParameterCounts
from cx_plugins.fsdp import block_classes, block_wrap_policy
from cx_plugins.models import GPT, GPTConfig

# a synthetic model: root unit 100 parameters (embeddings, norm, head), blocks of 300, 500 and 400
_COUNTS = ParameterCounts(1300, 100, 90, (300, 500, 400), (0, 0, 0), 0, False)
_TRACE = ActivationTrace(0, 2 * 1300, 7000, 60, 2 * 1300, 0, 5000, 1300)


def test_candidate_wrap_is_validated_labelled_and_printed() -> None:
    block = Candidate("torch_fsdp", dp=8, fsdp_wrap="block")
    assert "per-block" in block.label()
    assert "per-block" not in Candidate("torch_fsdp", dp=8).label()
    call = constructor_call(block, "LlamaDecoderLayer")
    assert call == "TorchFSDPPlugin(auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))"
    assert constructor_call(Candidate("torch_fsdp", dp=8)) == "TorchFSDPPlugin()"
    assert "--fsdp-wrap" not in train_command(block, "llama", 32)  # cx-train's torch_fsdp is per block by default
    assert train_command(Candidate("torch_fsdp", dp=8), "llama", 32).endswith("--fsdp-wrap model")
    with pytest.raises(ValueError, match="unknown fsdp_wrap 'layer'"):
        Candidate("torch_fsdp", fsdp_wrap="layer")
    with pytest.raises(ValueError, match="TorchFSDPPlugin setting, not hybrid's"):
        Candidate("hybrid", fsdp_wrap="block")


def test_per_block_memory_arithmetic() -> None:
    # bf16 compute (2 bytes), dp 4; n = 1300, root unit 100, the two largest blocks 500 + 400
    block = predict_memory_from_traces(Candidate("torch_fsdp", dp=4, fsdp_wrap="block"), [_TRACE], _COUNTS)
    whole = predict_memory_from_traces(Candidate("torch_fsdp", dp=4), [_TRACE], _COUNTS)
    shard, moments = 4 * 1300 // 4, 8 * 1300 // 4
    assert (block.parameters, block.optimizer_states, block.gradients) == (shard, moments, 60)
    assert block.comm_buffers == 2 * (100 + 500 + 400)  # the root unit and two blocks, in bf16
    assert whole.comm_buffers == 2 * 1300  # one root unit: the whole model
    regather = shard + moments + 5000 + 2 * 2 * 100  # all-gather output + unsharded root, saved activations
    # the root's reduce-scatter, resharded first: its bf16 gradients, then the fp32 output, beside the fp32 input
    reduce = shard + moments + 4 * 1200 // 4 + 4 * 100 + max(2 * 100, 4 * 100 // 4)
    assert block.end_of_backward == max(regather, reduce)
    whole_reduce = shard + moments + 4 * 1300 + max(2 * 1300, 4 * 1300 // 4)
    assert whole.end_of_backward == max(shard + moments + 5000 + 2 * 2 * 1300, whole_reduce)
    assert block.peak < whole.peak
    # on CPU devices cx reduces in place on gloo as NCCL does (gloo's own reduce-scatter copies its whole input, and
    # its worker thread frees that copy before or after the next unshard): the same bytes
    on_cpu = predict_memory_from_traces(Candidate("torch_fsdp", dp=4), [_TRACE], _COUNTS, host_is_device=True)
    assert on_cpu.end_of_backward == whole.end_of_backward
    # a trace whose peak is its piled-up unsharded gradients (a 70B model's outweigh its activations): per block FSDP
    # holds only the root unit's and the largest block's, beside the forward's saved activations
    piled = dataclasses.replace(_TRACE, activation_bytes=100, gradient_bytes=2 * 1300)
    block_piled = predict_memory_from_traces(Candidate("torch_fsdp", dp=4, fsdp_wrap="block"), [piled], _COUNTS)
    assert (block_piled.gradients, block_piled.activations) == (2 * (100 + 500), 5000)
    whole_piled = predict_memory_from_traces(Candidate("torch_fsdp", dp=4), [piled], _COUNTS)
    assert (whole_piled.gradients, whole_piled.activations) == (2 * 1300, 100)  # one root unit piles them up too
    # gradient accumulation under no_sync: every unit's unsharded gradient summed in fp32 through the last backward
    accumulating = Candidate("torch_fsdp", dp=4, fsdp_wrap="block", num_microbatches=2)
    acc = predict_memory_from_traces(accumulating, [_TRACE], _COUNTS)
    assert acc.gradients == block.gradients + 4 * 1300
    acc_reduce = shard + moments + 4 * 1200 // 4 + 4 * 100 + max(4 * 100, 4 * 100 // 4)
    assert acc.end_of_backward == max(regather + 4 * 1300, acc_reduce)
    with pytest.raises(ValueError, match="per-block FSDP needs the model's parameter counts"):
        predict_memory_from_traces(Candidate("torch_fsdp", dp=4, fsdp_wrap="block"), [_TRACE])


def test_block_wrap_policy_finds_the_decoder_layers() -> None:
    gpt = GPT(GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=2, num_heads=2))
    assert [cls.__name__ for cls in block_classes(gpt)] == ["_Block"]
    assert block_wrap_policy(gpt)(module=gpt.blocks[0], recurse=False, nonwrapped_numel=1)
    assert not block_wrap_policy(gpt)(module=gpt.lm_head, recurse=False, nonwrapped_numel=1)
    with torch.device("meta"):
        llama = build_model(load_model_shape("llama"))
    assert [cls.__name__ for cls in block_classes(llama)] == ["LlamaDecoderLayer"]
    with pytest.raises(ValueError, match=r"no nn\.ModuleList of decoder layers"):
        block_classes(nn.Linear(2, 2))


def test_plan_offers_both_ranks_per_block_first_on_ties_and_names_the_layer_class() -> None:
    from cx_plan import SearchSpace, plan
    from cx_plan._devices import lookup_device
    from cx_plan._planner import traced_memory_model

    shape = load_model_shape("llama", hidden_size=64, num_layers=2, seq_len=32)
    device = lookup_device("cpu")
    space = SearchSpace(plugins=("torch_fsdp",), global_batch=4, checkpoint_ratios=(0.0,), precision="fp32")
    report = plan(shape, 2, 32, device, traced_memory_model(shape, 32, device), space=space)
    assert {r.candidate.fsdp_wrap for r in report.rows} == {"block", "model"}
    assert report.block_class == "LlamaDecoderLayer"
    by_wrap = {r.candidate.fsdp_wrap: r for r in report.rows if r.candidate.micro_batch_size == 2}
    assert by_wrap["block"].memory.peak_bytes < by_wrap["model"].memory.peak_bytes
    # equal step times and verdicts: per block first, whichever order they come in
    same = [dataclasses.replace(by_wrap[wrap], step=by_wrap["block"].step, memory=by_wrap["block"].memory)
            for wrap in ("model", "block")]  # fmt: skip
    assert [r.candidate.fsdp_wrap for r in rank_rows(same)] == ["block", "model"]
