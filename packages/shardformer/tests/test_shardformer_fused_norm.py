"""enable_fused_normalization's rules: a `*RMSNorm` class is fused only when its forward computes torch's RMSNorm
(checked on a probe, per class), and the fused module keeps the hooks a policy put on the original."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cx_shardformer.policies._fused_norm import computes_rms_norm, fuse_rms_norms

transformers = pytest.importorskip("transformers")

SAME = ["llama.LlamaRMSNorm", "qwen3.Qwen3RMSNorm", "mixtral.MixtralRMSNorm", "deepseek_v3.DeepseekV3RMSNorm"]
DIFFERENT = ["gemma.GemmaRMSNorm", "gemma2.Gemma2RMSNorm", "gemma3.Gemma3RMSNorm"]  # x / rms(x) * (1 + weight)


def _norm(path: str, size: int = 8) -> nn.Module:
    family, name = path.split(".")
    module = getattr(getattr(transformers.models, family), f"modeling_{family}")
    norm: nn.Module = getattr(module, name)(size, eps=1e-6)
    return norm


@pytest.mark.parametrize("path", SAME + DIFFERENT)
def test_shardformer_fused_norm_probe_tells_the_function(path: str) -> None:
    assert computes_rms_norm(_norm(path)) == (path in SAME)
    with torch.device("meta"):  # a model built on meta (lazy init) is checked the same way
        assert computes_rms_norm(_norm(path)) == (path in SAME)


class _Block(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(x)
        return out


def test_shardformer_fused_norm_keeps_gemma_and_warns() -> None:
    block = _Block(_norm("gemma.GemmaRMSNorm"))
    with torch.no_grad():
        for parameter in block.norm.parameters():
            parameter.normal_()
    x = torch.randn(2, 3, 8)
    before = block(x)
    with pytest.warns(UserWarning, match="GemmaRMSNorm does not compute torch's RMSNorm"):
        assert fuse_rms_norms(block) == 0
    assert type(block.norm).__name__ == "GemmaRMSNorm"
    torch.testing.assert_close(block(x), before, rtol=0, atol=0)


def test_shardformer_fused_norm_swaps_llama_with_its_hooks() -> None:
    block = _Block(_norm("llama.LlamaRMSNorm"))
    (weight,) = block.norm.parameters()
    with torch.no_grad():
        weight.normal_()
    x = torch.randn(2, 3, 8)
    before = block(x)
    calls: list[str] = []
    block.norm.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    handle = block.norm.register_forward_hook(lambda module, args, output: output * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fuse_rms_norms(block) == 1
    assert isinstance(block.norm, nn.RMSNorm)
    assert block.norm.weight is weight  # the same Parameter: optimizers and checkpoints see no change
    torch.testing.assert_close(block(x), 2 * before, rtol=1e-6, atol=1e-6)  # the hook moved with the module
    assert calls == ["pre"]
    handle.remove()  # the policies' handles still reach the hooks
    torch.testing.assert_close(block(x), before, rtol=1e-6, atol=1e-6)
