"""`cx-train --model`: every transformers preset trains under a cx plugin exactly as under DDP, a local model folder
(with its own tokenizer) trains, checkpoints and resumes exactly, and bad models/flags are refused before any
process starts. Skipped when transformers is not installed."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cx_plugins
from cx_mesh.testing import distributed
from cx_train import GrammarText, TrainOptions, parse_options
from cx_train._train import run
from cx_train.data._grammar import CharTokenizer
from cx_train.metrics._progress import expert_counts
from cx_train.models._plugins import plan_candidate, plugin_extras
from cx_train.models._spec import ModelError, ModelSpec, build_model, check_builds, describe_model

transformers = pytest.importorskip("transformers")

TINY = ["--steps", "5", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2"]
SMALL = ["--hidden-size", "32"]  # for the built-in models (a folder brings its own size)
RTOL = 1e-4


def _options(*flags: str) -> TrainOptions:
    return parse_options([*TINY, "--log-every", "100", *flags])


def _assert_same_losses(losses: list[float], expected: list[float], what: str) -> None:
    assert len(losses) == len(expected), what
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert math.isfinite(got), f"{what}: step {step} loss {got}"
        assert abs(got - want) <= RTOL * abs(want), f"{what}: step {step} loss {got} != {want}"


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("model", "plugin"),
    [
        ("gpt2", "gemini"),
        ("llama", "low_level_zero"),
        ("mixtral", "gemini"),
        ("qwen3_moe", "torch_fsdp"),
        ("deepseek_v3", "low_level_zero"),
    ],
)
def test_train_models_preset_trains_as_under_ddp(rank: int, world_size: int, model: str, plugin: str) -> None:
    reference = run(_options(*SMALL, "--model", model, "--plugin", "torch_ddp"))  # same seed: weights and batches
    losses = run(_options(*SMALL, "--model", model, "--plugin", plugin))
    _assert_same_losses(losses, reference, f"{model} under {plugin}")
    assert losses[-1] < losses[0], f"{model}: the loss did not fall over 5 steps: {losses}"


def _model_folder(folder: Path, vocab_size: int = 96, with_tokenizer: bool = True) -> None:
    """A tiny Llama saved with save_pretrained, and a BPE tokenizer trained on the demo's grammar."""
    from tokenizers import Tokenizer, models, trainers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    if with_tokenizer:
        tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"])
        tokenizer.train_from_iterator([GrammarText(0).generate(5000)], trainer)
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
        fast.save_pretrained(str(folder))


@distributed(world_size=2)
def test_train_models_folder_trains_saves_and_resumes_exactly(rank: int, world_size: int, tmp_path: Path) -> None:
    source, checkpoint = tmp_path / "llama", tmp_path / "ckpt"
    if rank == 0:
        _model_folder(source)
    dist.barrier()
    described = describe_model(ModelSpec(str(source), 0, 0, 16))
    assert described.tokenizer.vocab_size == 80, "the folder's own tokenizer must be used"

    straight = run(_options("--model", str(source), "--plugin", "torch_ddp", "--steps", "6"))
    first = run(_options("--model", str(source), "--plugin", "gemini", "--steps", "3", "--save", str(checkpoint)))
    rest = run(_options("--model", str(source), "--plugin", "torch_ddp", "--steps", "6", "--resume", str(checkpoint)))
    _assert_same_losses(first + rest, straight, "3 steps under Gemini + 3 resumed under DDP vs 6 under DDP")

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint / "model"), local_files_only=True, output_loading_info=True
    )
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    original = transformers.AutoModelForCausalLM.from_pretrained(str(source), local_files_only=True)
    trained = dict(loaded.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in original.named_parameters()), "the weights did not train"


def test_train_models_folder_without_tokenizer_uses_the_character_encoding(tmp_path: Path) -> None:
    """A folder with weights and config only: the demo's own character encoding feeds it (its vocabulary of 96 holds
    every id), and the windows it trains on are those ids."""
    _model_folder(tmp_path / "llama", with_tokenizer=False)
    described = describe_model(ModelSpec(str(tmp_path / "llama"), 0, 0, 16))
    assert isinstance(described.tokenizer, CharTokenizer)
    options = parse_options([*TINY, "--model", str(tmp_path / "llama"), "--plugin", "torch_ddp"])
    assert options.model_spec.is_folder


def test_train_models_config_file_trains_from_fresh_weights(tmp_path: Path) -> None:
    """`--model path/to/any.json` (what cx-plan reads and prints back in its cx-train command): the architecture from
    the file, fresh seeded weights (the same on every rank and run), the demo's character encoding."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    path = tmp_path / "llama_tiny.json"
    config.to_json_file(str(path))
    options = parse_options([*TINY, "--model", str(path), "--plugin", "torch_ddp"])
    assert options.model_spec.is_config_file
    described = describe_model(options.model_spec)
    assert isinstance(described.tokenizer, CharTokenizer)
    assert (described.num_layers, described.num_kv_heads) == (2, 2)
    first, second = build_model(described, seed=5), build_model(described, seed=5)
    assert type(first).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    (tmp_path / "not_json.json").write_text("{ not json")
    with pytest.raises(ModelError, match="transformers cannot read it as a model config"):
        describe_model(ModelSpec(str(tmp_path / "not_json.json"), 0, 0, 16))
    # configs transformers refuses to make (a validator) or to build (an unknown rope type): refused before any
    # process starts, in one line (they were a 30-line traceback, the second one in every rank)
    raw = json.loads(path.read_text())
    (tmp_path / "rejected.json").write_text(json.dumps({**raw, "hidden_size": 30}))
    with pytest.raises(ModelError, match=r"cannot read it as a model config: .*hidden size \(30\) is not a multiple"):
        describe_model(ModelSpec(str(tmp_path / "rejected.json"), 0, 0, 16))
    (tmp_path / "unbuildable.json").write_text(json.dumps({**raw, "rope_scaling": {"rope_type": "nonsense"}}))
    described = describe_model(ModelSpec(str(tmp_path / "unbuildable.json"), 0, 0, 16))
    with pytest.raises(ModelError, match=r"cannot build a model of this config: KeyError: 'nonsense'"):
        check_builds(described)


def test_train_models_expert_counts() -> None:
    layer0 = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 1.0], [4.0, 0.0, 3.0]])  # top-2: {0,1} {1,2} {0,2}
    layer1 = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 1.0], [0.0, 3.0, 0.0]])  # top-1: 0, 0, 1
    assert torch.equal(expert_counts([layer0], 2), torch.tensor([[2.0, 2.0, 2.0]], dtype=torch.float64))
    assert torch.equal(expert_counts([layer1], 1), torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64))


class _FakePlugin:
    """Stands in for a hybrid plugin this checkout lacks, so the layout checks behind the availability one run."""


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        parse_options(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_train_models_refuses_bad_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--model nope: neither a built-in model" in _refused(["--model", "nope"], capsys)
    (tmp_path / "empty").mkdir()
    assert "no config.json there" in _refused(["--model", str(tmp_path / "empty")], capsys)
    _model_folder(tmp_path / "small_vocab", vocab_size=16, with_tokenizer=False)
    error = _refused(["--model", str(tmp_path / "small_vocab")], capsys)
    assert "vocab_size 16 is smaller than the" in error
    assert "character encoding" in error
    _model_folder(tmp_path / "tokenizer_too_big", vocab_size=64)  # its tokenizer has 80 ids
    assert "vocab_size 64 is smaller than the 80 token ids its tokenizer" in _refused(
        ["--model", str(tmp_path / "tokenizer_too_big")], capsys
    )
    _model_folder(tmp_path / "fine")
    folder = str(tmp_path / "fine")
    assert "--hidden-size applies to the built-in models" in _refused(
        ["--model", folder, "--hidden-size", "64"], capsys
    )
    assert "at most 64 positions; use --seq-len 63" in _refused(["--model", folder, "--seq-len", "64"], capsys)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    state = {"step": 3, "plugin": "gemini", "world_size": 2, "model": "llama", "hidden_size": 32, "num_layers": 2}
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    resume = ["--resume", str(checkpoint)]
    assert "the checkpoint is of --model llama, not gpt2" in _refused([*resume, "--model", "gpt2"], capsys)
    assert "has --hidden-size 32, not 128" in _refused([*resume, "--model", "llama"], capsys)
    assert parse_options([*resume, "--model", "llama", "--hidden-size", "32"]).resume == checkpoint
    assert "multiple of 8 for --model llama" in _refused(["--model", "llama", "--hidden-size", "36"], capsys)


def test_train_models_parallel_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delattr(cx_plugins, "HybridParallelPlugin", raising=False)
    monkeypatch.delattr(cx_plugins, "MoeHybridParallelPlugin", raising=False)
    assert "HybridParallelPlugin is not available yet" in _refused(["--plugin", "hybrid"], capsys)
    error = _refused(["--plugin", "moe_hybrid", "--model", "mixtral", "--ep", "2"], capsys)
    assert "MoeHybridParallelPlugin is not available yet" in error
    error = _refused(["--plugin", "torch_ddp", "--tp", "2"], capsys)
    assert "--tp applies to --plugin hybrid, moe_hybrid or gemini only (not torch_ddp)" in error
    error = _refused(["--pp", "2"], capsys)
    assert "--pp applies to --plugin hybrid or moe_hybrid only (not gemini; gemini takes --tp alone)" in error
    assert "--zero applies to --plugin hybrid" in _refused(["--plugin", "torch_ddp", "--zero", "1"], capsys)
    error = _refused(["--plugin", "low_level_zero", "--zero", "0"], capsys)
    assert "--zero 0 is not a LowLevelZero stage: --plugin low_level_zero runs --zero 1 or 2" in error
    llz = ["--plugin", "low_level_zero", "--nproc", "2"]  # the plugin's arguments, without a process group
    arguments: list[object] = [_arguments(parse_options(flags)) for flags in ([*llz, "--zero", "1"], llz)]
    assert arguments == [{"stage": 1, "precision": "fp32"}, {"stage": 2, "precision": "fp32"}]

    monkeypatch.setattr(cx_plugins, "HybridParallelPlugin", _FakePlugin, raising=False)
    monkeypatch.setattr(cx_plugins, "MoeHybridParallelPlugin", _FakePlugin, raising=False)
    hybrid = ["--plugin", "hybrid"]
    assert "--ep (expert parallelism) applies to --plugin moe_hybrid only" in _refused([*hybrid, "--ep", "2"], capsys)
    assert "--microbatches needs --pp 2 or more" in _refused([*hybrid, "--microbatches", "2"], capsys)
    assert "--pp-layers needs --pp 2 or more" in _refused([*hybrid, "--pp-layers", "balanced"], capsys)
    balanced = parse_options([*hybrid, "--pp", "2", "--nproc", "2", "--pp-layers", "balanced"])
    assert plugin_extras(balanced) == {"num_layers_per_stage": "balanced"}
    assert plugin_extras(parse_options([*hybrid, "--pp", "2", "--nproc", "2"])) == {}
    error = _refused([*hybrid, "--tp", "2", "--nproc", "3"], capsys)
    assert "3 processes do not split into tp 2 x pp 1 x sp 1 = 2: use --nproc 2, 4, 6" in error
    error = _refused([*hybrid, "--pp", "2", "--microbatches", "3", "--nproc", "2"], capsys)
    assert "--batch-size 8 does not split into 3 micro-batches: use --microbatches 1, 2, 4, 8" in error
    assert "2 layers do not split into 4 stages" in _refused([*hybrid, "--pp", "4", "--nproc", "4"], capsys)
    assert "tp must be one of 1, 2" in _refused([*hybrid, "--model", "llama", "--tp", "4", "--nproc", "4"], capsys)
    # all_to_all scatters heads over sp (llama's 4 heads, 2 per tp rank); ring_attn splits the sequence only
    error = _refused(
        [*hybrid, "--model", "llama", "--tp", "2", "--sp", "4", "--sp-mode", "all_to_all", "--nproc", "8"], capsys
    )
    assert "(2 per tp rank) do not split over sp 4 (--sp-mode all_to_all scatters heads)" in error
    assert "--sp-mode ring_attn" in error
    assert "--seq-len 64 must be a multiple of --sp 3" in _refused([*hybrid, "--sp", "3", "--nproc", "3"], capsys)
    moe = ["--plugin", "moe_hybrid"]
    assert "needs a model with experts" in _refused([*moe, "--model", "llama"], capsys)
    error = _refused([*moe, "--model", "mixtral", "--ep", "3", "--nproc", "6", "--tp", "2"], capsys)
    assert "--ep 3 must divide the model's 4 experts: use --ep 1, 2, 4" in error
    error = _refused([*moe, "--model", "mixtral", "--ep", "4", "--nproc", "4", "--tp", "2"], capsys)
    assert "--ep 4 must divide the data-parallel size 2 (processes / (tp*pp*sp)): use --ep 1, 2" in error

    error = _refused([*moe, "--model", "deepseek_v3", "--pp", "2", "--nproc", "2"], capsys)
    assert "--pp with a DeepSeek-V3 model is not supported by cx yet" in error
    options = parse_options([*moe, "--model", "qwen3_moe", "--nproc", "4", "--sp", "2", "--ep", "2"])
    assert _arguments(options)["sp_size"] == 2
    assert _arguments(options)["ep_size"] == 2
    options = parse_options([*moe, "--model", "mixtral", "--nproc", "8", "--tp", "2", "--pp", "2", "--ep", "2"])
    assert _arguments(replace(options, zero=1)) == {
        "tp_size": 2, "pp_size": 2, "ep_size": 2, "zero_stage": 1, "precision": "fp32", "pp_style": "1f1b",
        "num_model_chunks": 1, "num_microbatches": 2,
    }  # fmt: skip
    options = parse_options([*hybrid, "--nproc", "2", "--sp", "2"])
    assert _arguments(options)["sp_size"] == 2
    assert _arguments(options)["sequence_parallelism_mode"] == "all_to_all"


def test_train_models_mixtral_end_to_end(tmp_path: Path) -> None:
    """The command line itself: the MoE numbers on the progress line, and a checkpoint Mixtral loads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    flags = [*TINY, *SMALL, "--model", "mixtral", "--log-every", "5", "--save", str(tmp_path / "ckpt")]
    result = subprocess.run(
        [sys.executable, "-m", "cx_train", *flags], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "model=mixtral (MixtralForCausalLM) plugin=gemini ranks=2" in result.stdout
    assert " aux " in result.stdout, result.stdout
    assert "experts max/mean " in result.stdout, result.stdout
    _, info = transformers.MixtralForCausalLM.from_pretrained(
        str(tmp_path / "ckpt" / "model"), local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info


def test_train_models_moe_hybrid_end_to_end() -> None:
    """`cx-train --model mixtral --plugin moe_hybrid --ep 2`: experts split over two processes, the MoE numbers on the
    progress line, the loss falls (its checkpoints: test_plugins_moe_checkpoint.py)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    flags = ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2", "--steps", "30", "--log-every", "10"]
    result = subprocess.run(
        [sys.executable, "-m", "cx_train", *flags], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "plugin=moe_hybrid ranks=2" in result.stdout
    assert " aux " in result.stdout, result.stdout
    assert "experts max/mean " in result.stdout, result.stdout
    losses = re.search(r"cx-train: loss ([0-9.]+) -> ([0-9.]+)", result.stdout)
    assert losses is not None, result.stdout
    assert float(losses.group(2)) < float(losses.group(1)) - 0.5


_LINE = re.compile(r"step \d+/\d+ loss ([0-9.]+) aux ([0-9.]+) experts max/mean ([0-9.]+) ")


def _progress_numbers(*flags: str) -> list[tuple[float, ...]]:
    """(loss, aux, experts max/mean) of every progress line rank 0 prints (empty on the other ranks)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(_options(*flags))
    return [tuple(float(v) for v in m.groups()) for m in _LINE.finditer(printed.getvalue())]


@distributed(world_size=2)
def test_train_models_moe_numbers_under_pipeline_and_sequence_parallelism(rank: int, world_size: int) -> None:
    """`--pp` reports the aux loss and expert balance from the last stage, and `--sp` trains on the same windows:
    both print the numbers of tensor parallelism (dp 1 everywhere, so the same batches; windows of 16 tokens)."""
    base = [*SMALL, "--model", "mixtral", "--plugin", "moe_hybrid", "--log-every", "1", "--steps", "3"]
    reference = _progress_numbers(*base, "--tp", "2", "--seq-len", "15")
    # one micro-batch: the aux loss is not linear in the batch, so more micro-batches would change the loss itself
    piped = _progress_numbers(*base, "--pp", "2", "--microbatches", "1", "--seq-len", "15")
    sequenced = _progress_numbers(*base, "--sp", "2", "--seq-len", "16")
    if rank != 0:
        return
    assert len(reference) == 3, "tensor parallelism printed no MoE numbers"
    for name, numbers in (("--pp 2", piped), ("--sp 2", sequenced)):
        assert len(numbers) == len(reference), f"{name}: {numbers}"
        for step, (got, want) in enumerate(zip(numbers, reference, strict=True)):
            assert all(abs(g - w) <= 2e-3 for g, w in zip(got, want, strict=True)), f"{name} step {step}: {got} {want}"


def _arguments(options: TrainOptions) -> dict[str, object]:
    """The plugin constructor's arguments for the flags: their candidate's (what make_plugin passes)."""
    return plan_candidate(options, options.nproc).plugin_arguments()
