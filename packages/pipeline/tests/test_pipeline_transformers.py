"""transformers decoders split into pipeline stages match the unsplit model on the same micro-batches (skips
without transformers): Llama (plus tied embeddings), Mixtral with output_router_logits=True (the aux loss pools
router logits of layers on both stages), GPT-2 (tied wte / lm_head)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_pipeline import GPT2Splitter, HFDecoderSplitter, PipelineConfigError, PipelineSplittable, split_model
from cx_pipeline._hf import check_packed_rows
from pipeline_helpers import assert_grads_match, batches, build_schedule, names_by_identity

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip


def _model(kind: str, layers: int) -> Any:
    torch.manual_seed(0)
    if kind == "llama" or kind == "llama-tied":
        config = transformers.LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=kind == "llama-tied", **SMALL)
        return transformers.LlamaForCausalLM(config)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            num_hidden_layers=layers, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.5, **SMALL,
        )  # fmt: skip
        return transformers.MixtralForCausalLM(config)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            output_router_logits=True, router_aux_loss_coef=0.5, **SMALL,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # dropout would draw different random numbers
    )
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 12), generator=generator)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one row: the mask must reach every stage
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _loss(outputs: Any, micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


def _splitter(kind: str, model: Any) -> PipelineSplittable:
    return GPT2Splitter(model) if kind == "gpt2" else HFDecoderSplitter(model)


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("kind", "style"),
    [("llama", "1f1b"), ("llama", "zbv"), ("mixtral", "1f1b"), ("mixtral", "interleaved"), ("llama-tied", "1f1b"),
     ("qwen3_moe", "1f1b"),
     ("gpt2", "1f1b")],
)  # fmt: skip
def test_transformers_model_in_two_stages(rank: int, world_size: int, kind: str, style: str) -> None:
    layers = 4 if style != "1f1b" else 3
    full = _model(kind, layers)
    full.config.use_cache = False
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule(style, world_size, 2)
    model = split_model(_splitter(kind, full), manager)
    names = names_by_identity(full)
    held = {names[id(p)] for p in model.parameters()}
    first_stage = manager.stage == 0
    embedding = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    holds_head = manager.locate_virtual_stage(manager.num_virtual_stages - 1)[0] == manager.stage
    assert (embedding in held) == (first_stage or (holds_head and kind in ("llama-tied", "gpt2")))
    assert len(held) < len(names)  # each rank holds only its layers
    if kind in ("llama-tied", "gpt2"):
        assert len(model.shared) == (1 if style == "1f1b" else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(2):
        batch = _batch(step)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        result = schedule.forward_backward_step(model, batches(batch), _loss, return_loss=True, return_outputs=True)
        expected = torch.zeros(())
        aux: list[torch.Tensor] = []
        for half in (slice(0, 2), slice(2, 4)):
            out = reference(**{k: v[half] for k, v in batch.items()})
            (out.loss / 2).backward()
            expected = expected + out.loss.detach() / 2
            if kind in ("mixtral", "qwen3_moe"):
                aux.append(out.aux_loss.detach())
        if result["loss"] is not None:
            torch.testing.assert_close(result["loss"], expected, atol=1e-5, rtol=1e-5)
            if kind in ("mixtral", "qwen3_moe"):
                assert result["outputs"].aux_loss is not None
                torch.testing.assert_close(result["outputs"].aux_loss, torch.stack(aux))
        assert assert_grads_match(model, full, reference, atol=1e-5, rtol=1e-4) > 0
        optimizer.step()
        reference_optimizer.step()


def test_unsupported_structure_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="GPT2Splitter"):
        HFDecoderSplitter(_model("gpt2", 2))
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(num_hidden_layers=2, head_dim=8, **SMALL))
    with pytest.raises(PipelineConfigError, match="not 'gemma'"):
        HFDecoderSplitter(gemma)


def test_flash_attention_refuses_packed_rows() -> None:
    """A stage under a flash attention implementation refuses several packed rows (restarting positions, no mask),
    which transformers would attend across; one row, a mask, or plain positions pass."""
    config = _model("llama", 2).config
    config._attn_implementation = "flash_attention_2"
    packed = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]])
    with pytest.raises(PipelineConfigError, match=r"flash_attention_2.*2 rows"):
        check_packed_rows(config, None, packed)
    check_packed_rows(config, None, packed[:1])
    check_packed_rows(config, torch.ones(2, 6), packed)
    check_packed_rows(config, None, torch.arange(6).expand(2, 6))
    config._attn_implementation = "sdpa"
    check_packed_rows(config, None, packed)
