"""Held-out accuracy of a small fine-tune under fp8, per plugin: ColossalAI's accuracy evidence, redone on CPU.

ColossalAI backed its fp8 switches with fine-tune accuracy (DDP BERT 0.832 fp32 vs 0.829 e4m3, PR #5928;
LowLevelZero BERT 84.4% vs 84.3% / 84.8% with fp8 communication, PR #5961). This trains the same tiny
`LlamaForSequenceClassification` from the same seed under each (plugin, precision) on 2 gloo ranks and scores it on
a held-out set large enough that a 0.5-point gap is several standard errors: bf16, fp8 matmuls (`use_fp8=True`,
tensorwise), fp8 communication (`fp8_communication=True`), both, and fp8 matmuls with `fp8_recipe=BLOCKWISE`. A
combination a plugin refuses is recorded with its error message. Every combination runs from each initialisation
seed (default 0 and 1; data and its order stay fixed) and is compared with bf16 from the same seed, on the same
examples: the bf16 runs' own seed-to-seed spread shows how far two equally good runs land apart.

The task (synthetic, learnable, not saturated in the budget): each token id t in [0, VOCAB - 1) carries a hidden
weight t % 5 - 2; the label says whether a sequence's weights sum above zero (sums of 0 are dropped). The model must
learn 255 token weights and add 64 of them up; the near-ties (a sum of +-1) are the hard cases.

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo python benchmarks/fp8/bench_accuracy.py [--steps 200] [--held-out 16384]
        [--lr 3e-3] [--plugins ...] [--precisions ...] [--seeds 0 1] [--results PATH]
Writes its table into benchmarks/fp8/RESULTS.md between accuracy-table markers that name the learning rate, so a run
at one lr never overwrites another lr's table. A run with a subset of --plugins replaces only those plugins' rows of
its lr's table (same steps, held-out size and seeds; otherwise the whole table): the plugins can run in turns.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.fp8 import ScalingRecipe
from cx_mesh.testing import spawn
from cx_plugins import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from cx_plugins.lr_scheduler import LinearWarmupLR

VOCAB, LENGTH, HIDDEN, LAYERS = 256, 64, 64, 2
PAD = VOCAB - 1  # never drawn: the classification head reads the last non-pad token, here always the last one
GLOBAL_BATCH, LR, WARMUP = 64, 3e-3, 20
EVAL_BATCH = 512


def markers(lr: float) -> tuple[str, str]:
    """The comments that open and close the table of runs at peak learning rate `lr`."""
    return f"<!-- accuracy tables, lr {lr:g}:", f"<!-- end accuracy tables, lr {lr:g} -->"


# precision name -> the plugin's fp8 arguments
PRECISIONS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8 matmuls (tensorwise)": {"use_fp8": True},
    "fp8 communication": {"fp8_communication": True},
    "fp8 matmuls + communication": {"use_fp8": True, "fp8_communication": True},
    "fp8 matmuls (blockwise)": {"use_fp8": True, "fp8_recipe": ScalingRecipe.BLOCKWISE},
}
# plugin name -> (plugin factory taking the fp8 arguments, Booster mixed_precision)
PLUGINS: dict[str, tuple[Callable[..., Plugin], str | None]] = {
    "TorchDDPPlugin": (TorchDDPPlugin, "bf16"),
    "LowLevelZeroPlugin stage 2": (functools.partial(LowLevelZeroPlugin, stage=2, precision="bf16"), None),
    "GeminiPlugin": (functools.partial(GeminiPlugin, precision="bf16"), None),
}


def dataset(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` sequences and their labels (1: the hidden token weights sum above zero), reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    kept = 0
    while kept < rows:
        draw = torch.randint(0, PAD, (2 * rows, LENGTH), generator=generator)
        total = (draw % 5 - 2).sum(dim=1)
        keep = total != 0
        ids.append(draw[keep])
        labels.append((total[keep] > 0).long())
        kept += int(keep.sum())
    return torch.cat(ids)[:rows], torch.cat(labels)[:rows]


def _model(seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
        num_key_value_heads=4, num_hidden_layers=LAYERS, max_position_embeddings=LENGTH, pad_token_id=PAD,
        use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForSequenceClassification(config)  # 2 labels: the config default


def _train_and_score(
    plugin_name: str,
    precision: str,
    seed: int,
    steps: int,
    held_out: tuple[torch.Tensor, torch.Tensor],
    lr: float = LR,
) -> dict[str, Any]:
    """One run: the plugin's refusal, or the held-out correctness (a '0'/'1' string), final loss and wall time."""
    make_plugin, mixed_precision = PLUGINS[plugin_name]
    start = time.perf_counter()
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = LinearWarmupLR(optimizer, steps, warmup_steps=WARMUP)
    try:
        plugin = make_plugin(**PRECISIONS[precision])
        booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
        boosted, wrapped, *_ = booster.boost(model, optimizer, lr_scheduler=scheduler)
    except (TypeError, ValueError) as error:  # the same on every rank: raised before any collective
        return {"refused": f"{type(error).__name__}: {error}"}
    assert wrapped is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    share = GLOBAL_BATCH // world
    train_ids, train_labels = dataset(steps * GLOBAL_BATCH, seed=1)
    losses: list[float] = []
    boosted.train()
    for step in range(steps):
        rows = slice(step * GLOBAL_BATCH + rank * share, step * GLOBAL_BATCH + (rank + 1) * share)
        loss = boosted(input_ids=train_ids[rows], labels=train_labels[rows]).loss
        booster.backward(loss, wrapped)
        wrapped.step()
        wrapped.zero_grad()
        scheduler.step()
        losses.append(float(loss.detach()))
    ids, labels = held_out
    half = len(ids) // world
    mine = slice(rank * half, (rank + 1) * half)
    boosted.eval()
    with torch.no_grad():
        logits = torch.cat([boosted(input_ids=chunk).logits for chunk in ids[mine].split(EVAL_BATCH)])
    correct = (logits.argmax(dim=-1) == labels[mine]).to(torch.uint8)
    gathered = [torch.empty_like(correct) for _ in range(world)]
    dist.all_gather(gathered, correct)
    tail = losses[-20:]
    return {
        "correct": "".join(str(int(c)) for c in torch.cat(gathered).tolist()),
        "final_loss": sum(tail) / len(tail),
        "minutes": (time.perf_counter() - start) / 60,
    }


def _worker(
    rank: int, world: int, runs: list[tuple[str, str, int]], steps: int, rows: int, lr: float, out: str
) -> None:
    held_out = dataset(rows, seed=2)
    results = []
    for plugin_name, precision, seed in runs:
        result = _train_and_score(plugin_name, precision, seed, steps, held_out, lr)
        results.append({"plugin": plugin_name, "precision": precision, "seed": seed, **result})
        if rank == 0:
            print(json.dumps({k: v for k, v in results[-1].items() if k != "correct"}), file=sys.stderr, flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def paired_gap(run: str, baseline: str) -> tuple[float, float]:
    """Accuracy difference in points (run - baseline, both scored on the same examples) and its standard error,
    from the examples the two disagree on (McNemar's): sqrt(n10 + n01 - (n10 - n01)^2 / n) / n."""
    n = len(run)
    n10 = sum(1 for a, b in zip(run, baseline, strict=True) if a == "1" and b == "0")
    n01 = sum(1 for a, b in zip(run, baseline, strict=True) if a == "0" and b == "1")
    return 100 * (n10 - n01) / n, 100 * math.sqrt(max(n10 + n01 - (n10 - n01) ** 2 / n, 0.0)) / n


def _accuracy(correct: str) -> float:
    return 100 * correct.count("1") / len(correct)


def _rows(results: list[dict[str, Any]], seeds: list[int]) -> list[str]:
    """One row per (plugin, precision): accuracy per seed and their mean; the gap to bf16 is the mean over seeds of
    the seed-matched paired gaps, its standard error the held-out sampling error of that mean."""
    runs = {(r["plugin"], r["precision"], r["seed"]): r for r in results}
    lines = []
    for plugin, precision in dict.fromkeys((r["plugin"], r["precision"]) for r in results):
        mine = [runs[plugin, precision, seed] for seed in seeds]
        if "refused" in mine[0]:
            empty = " |" * (len(seeds) + 5)  # the columns after the first accuracy one
            lines.append(f"| {plugin} | {precision} | refused: `{mine[0]['refused']}` |{empty}")
            continue
        accuracies = [_accuracy(r["correct"]) for r in mine]
        mean = sum(accuracies) / len(accuracies)
        error = math.sqrt(sum(a * (100 - a) / len(r["correct"]) for a, r in zip(accuracies, mine, strict=True)))
        cells = [f"{a:.2f}" for a in accuracies] + [f"{mean:.2f} +- {error / len(mine):.2f}"]
        if precision == "bf16":
            spread = max(accuracies) - min(accuracies)
            cells += [f"(seed spread {spread:.2f})", "", ""]
        else:
            gaps = [
                paired_gap(r["correct"], runs[plugin, "bf16", seed]["correct"])
                for r, seed in zip(mine, seeds, strict=True)
            ]
            gap = sum(g for g, _ in gaps) / len(gaps)
            gap_error = math.sqrt(sum(e * e for _, e in gaps)) / len(gaps)
            within = "yes" if abs(gap) <= 0.5 else f"**no** ({'higher' if gap > 0 else 'lower'})"
            cells += [f"{gap:+.2f} +- {gap_error:.2f}", " / ".join(f"{g:+.2f}" for g, _ in gaps), within]
        loss = sum(r["final_loss"] for r in mine) / len(mine)
        minutes = sum(r["minutes"] for r in mine) / len(mine)
        lines.append(f"| {plugin} | {precision} | {' | '.join(cells)} | {loss:.4f} | {minutes:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=list(PLUGINS))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (global batch 64)")
    parser.add_argument("--lr", type=float, default=LR, help="peak AdamW learning rate (3e-3: fast, on the edge)")
    parser.add_argument("--held-out", type=int, default=16384, help="held-out sequences (even)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="model initialisation seeds")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    if args.steps <= WARMUP or args.held_out % 2:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps and --held-out must be even")
    precisions = ["bf16", *(q for q in args.precisions if q != "bf16")]
    runs = [(p, q, seed) for p in args.plugins for q in precisions for seed in args.seeds]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(_worker, 2, runs, args.steps, args.held_out, args.lr, out, timeout=3600)
        results: list[dict[str, Any]] = json.loads(Path(out).read_text())
    minutes = (time.perf_counter() - started) / 60
    command = shlex.join(["python", "benchmarks/fp8/bench_accuracy.py", *sys.argv[1:]])
    start, end = markers(args.lr)
    lines = [
        f"{start} `{command}`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {minutes:.1f} minutes -->",
        "",
        f"### Held-out accuracy, 2 gloo ranks, {args.steps} steps x {GLOBAL_BATCH} sequences, "
        f"{args.held_out} held-out sequences",
        "",
        "| plugin | precision | "
        + "".join(f"accuracy %, seed {seed} | " for seed in args.seeds)
        + "mean (+- 1 s.e.) | mean gap to bf16, points (+- paired s.e.) | gap per seed | within 0.5 | "
        "train loss, last 20 steps | minutes per run |",
        "|---" * (len(args.seeds) + 8) + "|",
        *_rows(results, args.seeds),
        end,
    ]
    print("\n".join(lines))  # this run's own rows, before any merge with the table already there
    text = args.results.read_text() if args.results.exists() else "# fp8 benchmark\n"
    section = merge_section(text, lines, args.plugins, args.lr)
    if start in text:
        text = text.split(start, 1)[0].rstrip("\n") + "\n\n" + section + text.split(start, 1)[1].split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    args.results.write_text(text)


def merge_section(text: str, lines: list[str], plugins: list[str], lr: float) -> str:
    """The new table section for `lr`: `lines` (comment, blank, heading, blank, header, rule, rows..., end), plus the
    rows of plugins this run left out, kept from the existing section when its heading and header match (same
    steps, held-out size and seeds); rows in PLUGINS order, the comment naming every run that left rows."""
    start, end = markers(lr)
    if start not in text:
        return "\n".join(lines)
    old = text.split(start, 1)[1].split(end, 1)[0].split("\n")
    if old[2:5] != lines[2:5]:  # heading, blank line, column header
        return "\n".join(lines)
    others = [name for name in PLUGINS if name not in plugins]
    kept = [row for row in old[6:] if row.startswith("| ") and row.split(" | ")[0][2:] in others]
    rows = sorted(kept + lines[6:-1], key=lambda row: list(PLUGINS).index(row.split(" | ")[0][2:]))
    comment = lines[0]
    if kept:
        comment = f"{start}{old[0].removesuffix(' -->')};{lines[0].removeprefix(start)}"
    return "\n".join([comment, *lines[1:6], *rows, end])


if __name__ == "__main__":
    main()
