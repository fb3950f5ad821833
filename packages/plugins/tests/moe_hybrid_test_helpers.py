"""Shared pieces of the MoeHybridParallelPlugin pipeline and sequence-parallel tests: tiny HF Mixtral and Qwen3-MoE
models (fp32, aux loss on) and a runner that trains the boosted model and a single-process copy side by side.

Data-parallel semantics (dp = moe_dp x ep): each dp rank trains on its own rows, and with pp > 1 cuts them into
micro-batches; the aux load-balancing loss is computed per forward (per micro-batch), pooled over all layers. So the
reference's loss is the mean over dp ranks and micro-batches of each piece's own loss (CE + coef * aux). Sequence
parallel ranks of one dp rank see the same rows (the model splits the sequence itself). Losses every step, then every
parameter this rank holds (TP shards and expert slices gathered by name) within the tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_moe import get_moe_info
from cx_plugins import Booster, HybridParallelModule, MoeHybridParallelPlugin
from cx_shardformer import get_shard_spec, unshard_tensor

VOCAB, ROWS, LENGTH, LR = 50, 4, 8, 0.1


def mixtral(layers: int = 2, top_k: int = 2) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=top_k,
        output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def qwen3_moe(layers: int = 2) -> nn.Module:
    """Qwen3-MoE with a dense MLP layer (`mlp_only_layers=[1]`) next to an MoE one."""
    import transformers

    torch.manual_seed(0)
    shape: dict[str, Any] = {"head_dim": 4}  # a keyword transformers' stubs do not list
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05, mlp_only_layers=[1],
        decoder_sparse_step=1, tie_word_embeddings=False, use_cache=False, **shape,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen3MoeForCausalLM(config)
    return model


def unrouted(model_fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Top-1 routing (build the model with top_k=1) restricted to experts 0 and 1 (frozen routers: logits
    (a, -a, 0, 0)): with ep 2, ep rank 1's experts 2 and 3 never receive a token."""

    def build() -> nn.Module:
        model = model_fn()
        gates = [weight for name, weight in model.named_parameters() if name.endswith("mlp.gate.weight")]
        assert gates, "the model has routers to freeze"
        for weight in gates:
            with torch.no_grad():
                weight[1].copy_(-weight[0])
                weight[2:].zero_()
            weight.requires_grad_(False)
        return model

    return build


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(100 + step))


def _loss(outputs: Any, _micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


def train_and_compare(
    plugin: MoeHybridParallelPlugin,
    model_fn: Callable[[], nn.Module] = mixtral,
    steps: int = 3,
    clip: float = 0.0,
    tol: float = 1e-4,
    freeze_experts: bool = False,
    freeze_dense: bool = False,
) -> HybridParallelModule:
    """Train `steps` steps with the plugin and a single-process copy; assert losses and held parameters match.
    `freeze_experts`: the expert stacks do not train (only the dense parameters and routers do); `freeze_dense`:
    only the expert stacks train (routers, attention, norms and embeddings frozen)."""
    model = model_fn()
    for name, param in model.named_parameters():
        expert = ".experts." in name
        if (freeze_experts and expert) or (freeze_dense and not expert):
            param.requires_grad_(False)
    reference = copy.deepcopy(model)
    booster = Booster(plugin=plugin)
    optimizer_in = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    boosted, optimizer, *_ = booster.boost(model, optimizer_in)
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    if plugin.ep_size > 1:  # every expert stack this rank holds is split over ep
        held = [(n, p) for n, p in boosted.unwrap().named_parameters() if n in boosted.held_parameter_names()]
        stacks = [n for n, _ in held if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        split = [n for n, p in held if get_moe_info(p) is not None]
        assert stacks, "this rank holds expert stacks"
        assert split == stacks, f"the experts of every MoE layer are split over ep: {split} vs {stacks}"
    ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = ROWS // dp_size
    microbatches = _microbatches(plugin, share)
    piece = share // microbatches
    losses, expected = [], []
    for step in range(steps):
        ids = rows(step)
        mine = ids[dp_rank * share : (dp_rank + 1) * share]
        loss: torch.Tensor | None
        if plugin.pp_size > 1:
            result = booster.execute_pipeline(
                iter([{"input_ids": mine, "labels": mine}]), boosted, _loss, optimizer, return_loss=True
            )
            loss = result["loss"]
        else:
            loss = boosted(input_ids=mine, labels=mine).loss
            booster.backward(loss, optimizer)
        if clip > 0:
            optimizer.clip_grad_by_norm(clip)
        optimizer.step()
        optimizer.zero_grad()
        pieces = [ids[i * piece : (i + 1) * piece] for i in range(ROWS // piece)]  # dp rank r: pieces of rows r*share
        ref_losses = [reference(input_ids=p, labels=p).loss for p in pieces]
        torch.stack(ref_losses).mean().backward()
        if clip > 0 or plugin.options.max_norm > 0:  # the plugin's own max_norm clips inside optimizer.step()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip or plugin.options.max_norm)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if loss is not None:
            losses.append(float(loss))
            mine_pieces = ref_losses[dp_rank * microbatches : (dp_rank + 1) * microbatches]
            expected.append(float(torch.stack(mine_pieces).mean()))
    if plugin.pp_size > 1:  # the rank holding the last chunk (the first rank under the V schedule) has the loss
        holders = torch.tensor([1.0 if losses else 0.0])
        dist.all_reduce(holders, group=plugin.pp_group)
        assert int(holders.item()) == 1, "exactly one stage returns the loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=tol, atol=tol / 10)
    compare_parameters(boosted, reference, plugin, tol)
    return boosted


def _microbatches(plugin: MoeHybridParallelPlugin, share: int) -> int:
    """Micro-batches per dp rank and step, as the plugin cuts them (the reference must cut its rows the same way)."""
    if plugin.pp_size == 1:
        return 1
    pipeline = plugin.options.pipeline
    if pipeline.num_microbatches is not None:
        return pipeline.num_microbatches
    assert pipeline.microbatch_size is not None
    return share // pipeline.microbatch_size


def compare_parameters(
    boosted: HybridParallelModule, reference: nn.Module, plugin: MoeHybridParallelPlugin, tol: float
) -> None:
    """Every parameter this rank holds, by name; TP shards gathered, expert slices gathered over ep."""
    expected = dict(reference.named_parameters())
    held = boosted.held_parameter_names()
    assert held, "every rank holds part of the model"
    for name, param in boosted.unwrap().named_parameters():
        if name not in held:
            assert param.device.type == "meta", f"{name} belongs to another stage and should be released"
            continue
        full = param.detach()
        spec = get_shard_spec(param)
        if spec is not None:
            full = unshard_tensor(full, spec, plugin.tp_group)
        if get_moe_info(param) is not None:
            parts = [torch.empty_like(full) for _ in range(plugin.ep_size)]
            dist.all_gather(parts, full.contiguous(), group=plugin.ep_group)
            full = torch.cat(parts, dim=0)
        torch.testing.assert_close(full.float(), expected[name].detach(), rtol=tol, atol=tol / 10, msg=_named(name))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def qwen2_moe() -> nn.Module:
    """Qwen2-MoE: q/k/v biases, a gated shared expert inside each MoE block; layer 1 dense."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=8, output_router_logits=True,
        router_aux_loss_coef=0.05, mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen2MoeForCausalLM(config)
    return model


def deepseek_v3() -> nn.Module:
    """DeepSeek-V3: layer 0 dense, layer 1 MoE with a shared expert; multi-head latent attention (value heads of
    another width than query/key heads)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=8,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=2.5,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.DeepseekV3ForCausalLM(config)
    return model
