"""A checkpoint carries the tokenizer it was trained with: its files beside the weights in `model/` (so transformers
loads model and tokenizer from there, and `--model CKPT/model --data ...` trains on with the same ids) and its
identity in `trainer.json`, so a `--resume` with another tokenizer (of the same vocabulary size too), another
`--seq-len` or `--seed` is refused before any process starts, naming both; another `--steps` under a decaying
schedule says in the log that the curve is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_checkpoint import VerifyOutcome, verify_checkpoints
from cx_mesh.testing import run_distributed
from cx_train import GrammarText
from cx_train._train import run
from cx_train.config._options import parse_options
from cx_train.config._resumed_model import schedule_note
from cx_train.models._spec import ModelSpec, describe_model
from cx_train.models._tokenizer_files import TokenizerIdentity, tokenizer_identity

VOCAB = 300  # 256 byte tokens, 2 special ones and 42 merges


def _bpe_llama_folder(folder: Path, seed: int) -> Path:
    """A tiny Llama and a byte-level BPE tokenizer trained on grammar text of `seed` (another seed: other merges,
    the same vocabulary size), saved with save_pretrained as a model folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = GrammarText(seed).generate(20000)
    backend.train_from_iterator([text[i : i + 500] for i in range(0, len(text), 500)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    assert len(tokenizer) == VOCAB
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def _train(rank: int, world_size: int, flags: list[str]) -> None:
    run(parse_options(flags, world_size=world_size))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """A model folder, the checkpoint of 2 steps on it with --data, and the flags that trained it."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tokenizer")
    folder = _bpe_llama_folder(root / "llama", seed=0)
    data = root / "text.txt"
    data.write_text(GrammarText(1).generate(6000))
    flags = ["--model", str(folder), "--data", str(data), "--plugin", "torch_ddp", "--seq-len", "16"]
    flags += ["--batch-size", "2", "--steps", "2", "--lr-schedule", "cosine", "--data-cache-dir", str(root / "cache")]
    outcomes = run_distributed(_train, 1, flags=[*flags, "--save", str(root / "ckpt")])
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    return folder, root / "ckpt", flags


def test_train_checkpoint_holds_the_tokenizer(trained: tuple[Path, Path, list[str]]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, checkpoint, _ = trained
    text = GrammarText(5).generate(300)
    original, saved = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(checkpoint / "model")
    assert saved(text)["input_ids"] == original(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    assert model.config.vocab_size == VOCAB
    assert json.loads((checkpoint / "model" / "generation_config.json").read_text())["eos_token_id"] == 1
    recorded = json.loads((checkpoint / "trainer.json").read_text())["tokenizer"]
    ids = [describe_model(ModelSpec(str(p), 0, 0, 16, own_data=True)).tokenizer for p in (folder, checkpoint / "model")]
    assert recorded == tokenizer_identity(ids[0]) == tokenizer_identity(ids[1])  # not the UTF-8 byte fallback
    assert TokenizerIdentity(recorded).vocab_size == VOCAB
    results = verify_checkpoints(checkpoint)  # the tokenizer files are checksummed with the rest
    assert results
    assert all(r.outcome is VerifyOutcome.OK for r in results), results


def test_train_checkpoint_model_folder_trains_on(trained: tuple[Path, Path, list[str]], tmp_path: Path) -> None:
    """`--model CKPT/model --data ...` reads the checkpoint's tokenizer (a new run from its weights)."""
    _, checkpoint, flags = trained
    flags = [*flags[2:], "--model", str(checkpoint / "model"), "--steps", "1", "--save", str(tmp_path / "next")]
    outcomes = run_distributed(_train, 1, flags=flags)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    following = json.loads((tmp_path / "next" / "trainer.json").read_text())["tokenizer"]
    assert following == json.loads((checkpoint / "trainer.json").read_text())["tokenizer"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv, world_size=1)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_train_resume_with_another_tokenizer_is_refused(
    trained: tuple[Path, Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checkpoint, flags = trained
    other = _bpe_llama_folder(tmp_path / "other", seed=9)  # the same model and vocabulary size, other merges
    error = _refused([*flags[2:], "--model", str(other), "--steps", "4", "--resume", str(checkpoint)], capsys)
    assert f"--resume {checkpoint}: the checkpoint was trained with a transformers tokenizer, vocabulary 300" in error
    assert "(the same vocabulary size, other tokens)" in error
    assert f"--model {checkpoint / 'model'}" in error


@pytest.mark.parametrize(("flag", "value", "saved"), [("--seq-len", "32", "16"), ("--seed", "7", "1024")])
def test_train_resume_with_another_seq_len_or_seed_is_refused(
    trained: tuple[Path, Path, list[str]], flag: str, value: str, saved: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checkpoint, flags = trained
    error = _refused([*flags, "--steps", "4", flag, value, "--resume", str(checkpoint)], capsys)
    assert f"the checkpoint's run had {flag} {saved}, this run has {flag} {value}; resume with {flag} {saved}" in error
    assert parse_options([*flags, "--steps", "4", "--resume", str(checkpoint)], world_size=1).resume == checkpoint


def test_train_resume_with_other_steps_rebuilds_a_decaying_curve(trained: tuple[Path, Path, list[str]]) -> None:
    _, checkpoint, _ = trained
    note = schedule_note(checkpoint, "cosine", 6)
    assert note is not None
    assert "--steps 6 is not the checkpoint's run's 2: the cosine learning-rate curve is rebuilt" in note
    assert schedule_note(checkpoint, "cosine", 2) is None
    assert schedule_note(checkpoint, "constant", 6) is None  # a constant rate has no curve to rebuild
