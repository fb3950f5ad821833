"""ShardFormer at tp 2 (fp32) on tiny transformers models against the unsharded copy: loss, logits and every
gradient equal; three AdamW steps with an optimizer built before sharding give the same full-size state dict.
Llama with grouped-query attention (checked and generic tp-plan policies), GPT-2 with tied embeddings and Conv1D;
vocabulary 50 not divisible by tp * 64 (padded). Skips without transformers."""

from __future__ import annotations

import pytest
import torch

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_shardformer import ShardConfig, ShardFormer, get_shard_spec
from cx_shardformer.policies import TPPlanPolicy
from shardformer_helpers import assert_close
from shardformer_models import VOCAB, build, compare_grads, compare_state, full_logits, tokens, twin

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["llama", "llama_plan", "gpt2"])
@pytest.mark.parametrize("parallel_output", [True, False])
def test_shardformer_policy_matches_unsharded(rank: int, world_size: int, kind: str, parallel_output: bool) -> None:
    model = build("gpt2" if kind == "gpt2" else "llama")
    reference = twin(model)
    params_before = {name: p for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, eps=TEST_ADAM_EPS
    )  # built before sharding: must keep working
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    config = ShardConfig(parallel_output=parallel_output)
    policy = TPPlanPolicy() if kind == "llama_plan" else None
    model, shared = ShardFormer(config).optimize(model, policy)
    assert shared == []
    for name, param in model.named_parameters():
        assert param is params_before[name], f"{name} is a new Parameter"
    sharded = [name for name, p in model.named_parameters() if get_shard_spec(p) is not None]
    assert any("q_proj" in n or "c_attn" in n for n in sharded)

    for step in range(3):
        ids = tokens(step)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        out = model(input_ids=ids, labels=ids)
        ref_out = reference(input_ids=ids, labels=ids)
        assert_close(out.loss, ref_out.loss.detach(), f"{kind} loss step {step}")
        if step == 0:
            logits = full_logits(out.logits, parallel_output)
            assert logits.shape[-1] == VOCAB
            assert_close(logits, ref_out.logits.detach(), f"{kind} logits")
        out.loss.backward()
        ref_out.loss.backward()
        if step == 0:
            compare_grads(model, reference, kind)
        optimizer.step()
        ref_optimizer.step()
    # GPT-2's key bias has a true gradient of zero (softmax ignores a shift shared by every key): at the default eps
    # Adam would normalise its rounding noise into lr-sized steps; at TEST_ADAM_EPS the layouts differ by rounding
    atol = tiny_model_adam_tolerance(1e-2, steps=3, tokens=ids.numel())
    compare_state(model, reference, f"{kind} after 3 AdamW steps", rtol=1e-4, atol=atol)
    fresh = build("gpt2" if kind == "gpt2" else "llama", initializer_range=0.5)
    model.load_state_dict(fresh.state_dict())  # full-size tensors load into the sharded model
    compare_state(model, fresh, f"{kind} after loading an unsharded state dict")


@pytest.mark.slow
@distributed(world_size=4)
def test_shardformer_policy_tp4_matches_unsharded(rank: int, world_size: int) -> None:
    """tp 4 where the heads allow (Llama 4 heads / 4 key-value heads, GPT-2 4 heads), then tp 2 x sp 2 with
    all_to_all and ring: loss and every gradient."""
    for kind, overrides in (("llama", {"num_key_value_heads": 4}), ("gpt2", {})):
        model = build(kind, **overrides)
        reference = twin(model)
        model, _ = ShardFormer(ShardConfig()).optimize(model)
        ids = tokens(2)
        out = model(input_ids=ids, labels=ids)
        ref_out = reference(input_ids=ids, labels=ids)
        assert_close(out.loss, ref_out.loss.detach(), f"{kind} tp4 loss")
        out.loss.backward()
        ref_out.loss.backward()
        compare_grads(model, reference, f"{kind} tp4")
    # tp 2 x sp 2 on a (sp, tp) mesh: 4 heads / 2 key-value heads leave 1 key-value head per tp rank, fewer than
    # sp, so all_to_all repeats it (grouped-query attention); ring needs no head split
    mesh = ProcessGroupMesh(2, 2, axis_names=("sp", "tp"))
    tp_group, sp_group = mesh.get_group_along_axis("tp"), mesh.get_group_along_axis("sp")
    for mode in ("all_to_all", "ring"):
        model = build("llama")
        reference = twin(model)
        config = ShardConfig(
            tensor_parallel_process_group=tp_group,
            sequence_parallel_process_group=sp_group,
            enable_sequence_parallelism=True,
            sequence_parallelism_mode=mode,
        )
        model, _ = ShardFormer(config).optimize(model)
        ids = tokens(3)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
        assert_close(out.loss, ref_out.loss.detach(), f"tp2 x sp2 {mode} loss")
        out.loss.backward()
        ref_out.loss.backward()
        compare_grads(model, reference, f"tp2 x sp2 {mode}", group=tp_group)


@distributed(world_size=2)
def test_shardformer_policy_bf16(rank: int, world_size: int) -> None:
    """bf16 weights (cast after sharding, as a plugin does): the specs survive the cast, and loss and gradients stay
    within bf16 rounding of the unsharded bf16 model's."""
    model = build("llama")
    reference = twin(model).to(torch.bfloat16)
    ShardFormer(ShardConfig()).optimize(model)  # in place: `model` is the sharded model
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert get_shard_spec(model.model.layers[0].self_attn.q_proj.weight) is not None
    ids = tokens(6)
    out = model(input_ids=ids, labels=ids)
    ref_out = reference(input_ids=ids, labels=ids)
    assert_close(out.loss.float(), ref_out.loss.float().detach(), "bf16 loss", rtol=1e-2, atol=1e-2)
    out.loss.backward()
    ref_out.loss.backward()
    compare_grads(model, reference, "bf16", rtol=5e-2, atol=5e-3)
