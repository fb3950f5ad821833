"""The optimisation flags checked against the plugin, the model and each other before any process starts, each
refusal naming the flag, why, and what works instead."""

from __future__ import annotations

import argparse

from cx_train.models._names import GPT_MODEL

__all__ = ["COMPILE_PLUGINS", "training_problem"]

COMPILE_PLUGINS = ("torch_ddp",)  # plugins whose boosted model is the user's module under a plain DDP wrapper


def training_problem(args: argparse.Namespace) -> str | None:
    """Why the optimisation flags in `args` cannot run together (None when they can)."""
    if args.warmup_steps > args.steps or (args.lr_schedule == "linear" and 0 < args.steps == args.warmup_steps):
        return (
            f"--warmup-steps {args.warmup_steps} must be below --steps {args.steps} (the total to reach); "
            "the schedule has no steps left after the warm-up"
        )
    if args.grad_accum > 1 and (args.pp or 1) > 1:
        return (
            "--grad-accum with --pp: a pipeline step already accumulates over its micro-batches; raise --batch-size "
            "and --microbatches instead"
        )
    if args.grad_accum > 1 and args.plugin == "gemini":
        return (
            "--grad-accum: the gemini plugin does not support gradient accumulation (no no_sync, as in ColossalAI); "
            "use --plugin low_level_zero, torch_ddp, torch_fsdp or hybrid, or a larger --batch-size"
        )
    selective = args.activation_checkpointing_mode != "full"
    if selective and args.plugin in ("hybrid", "moe_hybrid"):
        return (
            f"--activation-checkpointing-mode {args.activation_checkpointing_mode}: --plugin {args.plugin} "
            "checkpoints whole layers through ShardFormer's policies, which take no op policy; use "
            "--activation-checkpointing alone, or a data-parallel plugin (torch_fsdp, torch_ddp, low_level_zero, "
            "gemini at --tp 1)"
        )
    if selective and args.plugin == "gemini" and (args.tp or 1) > 1:
        return (
            f"--activation-checkpointing-mode {args.activation_checkpointing_mode} with --plugin gemini --tp "
            f"{args.tp}: torchtitan's op policy is untested around ShardFormer's tensor-parallel layers (as under "
            "--plugin hybrid); use --activation-checkpointing alone (whole layers), or --tp 1"
        )
    ratio = args.activation_checkpointing_ratio or 0.0
    if (args.activation_checkpointing or selective or ratio > 0) and args.model == GPT_MODEL:
        return (
            "--activation-checkpointing: cx's reference GPT has no activation checkpointing; use a transformers "
            "model (--model llama, mixtral, ... or a model folder)"
        )
    if args.compile and args.plugin not in COMPILE_PLUGINS:
        return (
            f"--compile is not supported with --plugin {args.plugin} (its boosted model is sharded or hooked in "
            f"ways torch.compile does not trace here); use --plugin {' or '.join(COMPILE_PLUGINS)}, or drop --compile"
        )
    return None
