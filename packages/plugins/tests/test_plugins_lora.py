"""LoRA fine-tuning through the Booster (peft adapters on a tiny HF GPT-2) against single-process peft training,
the adapters saved in peft's format and loaded back, and clear errors where LoRA is not supported (those tests are
skipped when transformers or peft is not installed); without peft, cx_plugins still imports and enable_lora says
how to install it."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, TorchFSDPPlugin
from plugins_test_helpers import ATOL, RTOL, make_plugin

HAVE_PEFT = all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft"))
transformers: Any = importlib.import_module("transformers") if HAVE_PEFT else None
peft: Any = importlib.import_module("peft") if HAVE_PEFT else None
needs_peft = pytest.mark.skipif(not HAVE_PEFT, reason="needs transformers and peft")

STEPS, GLOBAL_BATCH, LENGTH, LR = 3, 4, 8, 1e-2


def _base() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config.attn_pdrop = 0.0
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def _config() -> object:
    # GPT-2's Conv1D stores weights [in, out]: peft needs fan_in_fan_out. init_lora_weights=False gives non-zero
    # B matrices, so the adapters change the output from the first step and the comparison means something.
    return peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0, init_lora_weights=False
    )


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items() if "lora_" in name}


@needs_peft
@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "zero2"])
def test_lora_training_matches_single_process_and_saves_in_peft_format(
    rank: int, world_size: int, plugin: str, tmp_path: Path
) -> None:
    booster = Booster(plugin=make_plugin(plugin))
    torch.manual_seed(1)
    model = booster.enable_lora(_base(), lora_config=_config())
    expected = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable, "LoRA must leave the adapters trainable"
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(trainable, lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    reference_optimizer = torch.optim.AdamW(
        [p for p in expected.parameters() if p.requires_grad], lr=LR, eps=TEST_ADAM_EPS
    )
    batches = torch.randint(0, 64, (STEPS, GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(5))
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(boosted(input_ids=mine, labels=mine).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        expected(input_ids=batch, labels=batch).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    trained = _adapters(model)
    reference = _adapters(expected)
    assert trained.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=RTOL, atol=ATOL, msg=name)
    frozen_before = dict(_base().state_dict())
    base_model: nn.Module = model.get_base_model()  # type: ignore[operator]
    for name, value in base_model.state_dict().items():
        if "lora_" not in name and name.replace("base_layer.", "") in frozen_before:
            torch.testing.assert_close(value, frozen_before[name.replace("base_layer.", "")], msg=name)

    target = tmp_path / "adapter"
    if rank == 0:  # the master rank writes, and says once that cx writes safetensors, never a pickle
        with pytest.warns(UserWarning, match="use_safetensors=False would write a pickle"):
            booster.save_lora_as_pretrained(boosted, target)
    else:
        booster.save_lora_as_pretrained(boosted, target)
    assert (target / "adapter_model.safetensors").is_file()
    assert not list(target.glob("*.bin"))
    loaded = peft.PeftModel.from_pretrained(_base(), str(target))
    for name, value in _adapters(loaded).items():
        torch.testing.assert_close(value, trained[name], msg=name)
    # and enable_lora(pretrained_dir=...) resumes training from the saved adapters
    resumed = Booster(plugin=make_plugin(plugin)).enable_lora(_base(), pretrained_dir=target)
    assert all(p.requires_grad for n, p in resumed.named_parameters() if "lora_" in n)
    for name, value in _adapters(resumed).items():
        torch.testing.assert_close(value, trained[name], msg=name)


@needs_peft
@distributed(world_size=1)
def test_lora_unsupported_plugins_and_misuse_are_clear_errors(rank: int, world_size: int) -> None:
    with pytest.raises(NotImplementedError, match="TorchFSDPPlugin does not support LoRA"):
        Booster(plugin=TorchFSDPPlugin()).enable_lora(_base(), lora_config=_config())
    booster = Booster(plugin=make_plugin("torch_ddp"))
    with pytest.raises(ValueError, match="needs a peft LoraConfig"):
        booster.enable_lora(_base())
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        booster.enable_lora(_base(), lora_config=_config(), quantize=True)
    model = booster.enable_lora(_base(), lora_config=_config())
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        booster.enable_lora(model, lora_config=_config())
    boosted, *_ = booster.boost(model)
    with pytest.raises(ValueError, match="before boost"):
        booster.enable_lora(boosted, lora_config=_config())
    plain, *_ = Booster(plugin=make_plugin("torch_ddp")).boost(_base())
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        booster.save_lora_as_pretrained(plain, "unused")


def test_lora_without_peft_imports_cx_plugins() -> None:
    # a fresh interpreter in which `import peft` fails, as where it is not installed
    script = "import sys; sys.modules['peft'] = None; import cx_plugins; print(cx_plugins.Booster.__name__)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Booster"


@distributed(world_size=1)
def test_lora_without_peft_enable_lora_gives_the_install_hint(rank: int, world_size: int) -> None:
    booster = Booster(plugin=make_plugin("torch_ddp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError, as when it is not installed
        with pytest.raises(ImportError, match=r"peft, which is not installed: pip install 'cx-plugins\[lora\]'"):
            booster.enable_lora(nn.Linear(4, 4), lora_config=object())
