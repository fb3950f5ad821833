"""Every `Candidate` a world size admits for a model: each plugin's valid layouts under the rules the plugins and
the shard policies enforce, the micro-batch splits of a fixed global batch, and activation checkpointing choices.

The rules (each the one the code that would run it checks):
- tp divides the attention heads, the key/value heads and the MLP width (cx-shardformer's policies);
- ep divides the routed experts (MoE policies) and the data-parallel ranks (moe_dp x ep);
- Ulysses sp divides the heads and key/value heads left per tp rank; ring attention needs the sequence to split
  into 2 x sp pieces (its zig-zag halves); every sequence split divides the sequence length;
- pp stages x model chunks do not exceed the layers; interleaved needs micro-batches a multiple of pp;
- the global batch (sequences per step) splits over dp evenly, into micro-batches of every divisor size; a
  pipeline needs at least pp micro-batches;
- ZeRO: LowLevelZero 1/2, hybrid and MoE hybrid 0/1/2 (bf16 optimizer states, when asked, on every layout with
  ZeRO 1/2 or Gemini; the others keep fp32 moments); FSDP (per decoder layer and as one root unit) and Gemini
  shard everything; Gemini tries static
  placement on the device, all optimizer state offloaded, and auto placement, with one micro-batch per step
  (GeminiDDP refuses accumulation as cx-train configures it);
- checkpointing: a ratio of layers under the hybrid plugins (ShardFormer); all or none under the others, and, when
  asked for (`checkpoint_modes`), every layer under torchtitan's selective op policy (transformers' switch only);
- optimizer muon (MuonWithAdamW): on every enumerated layout but Gemini's at tp > 1 (`optimizer_skips` says so
  once for the report);
- Gemini's tp_size > 1 (`_gemini_tp`): tp divides the heads and MLP width as above, dp = world / tp, no pp or sp,
  full checkpointing only (the selective op policy does not wrap ShardFormer's tp layers); under AdamW only (its
  Muon owners over dp and tp are not modelled: `optimizer_skips`).
When no candidate survives, `NoLayoutError` names, per plugin, why.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cx_plan._candidate import PLUGINS, Candidate, Optimizer
from cx_plan._expert_load import ExpertLoad
from cx_plan.trace._model_spec import ModelShape

__all__ = ["NoLayoutError", "SearchSpace", "enumerate_candidates", "optimizer_skips"]


class NoLayoutError(ValueError):
    """No configuration of any requested plugin splits this world for this model and batch."""


@dataclass(frozen=True)
class SearchSpace:
    """What to try: plugins, the global batch in sequences (None: 4 per rank), checkpointing ratios and modes
    ("selective-op": every layer under the op policy, data-parallel plugins only), pipeline styles, and the largest
    tp / pp (tp rarely pays beyond a node's 8 devices)."""

    plugins: Sequence[str] = PLUGINS
    global_batch: int | None = None
    checkpoint_ratios: Sequence[float] = (0.0, 1.0)
    checkpoint_modes: Sequence[str] = ("full",)
    pp_styles: Sequence[str] = ("1f1b", "interleaved", "zbv")
    max_tp: int = 8
    max_pp: int = 16
    precision: str = "bf16"
    optimizer_states_dtype: str = "fp32"  # "bf16": Adam's moments in bf16 wherever the layout runs ZeRO 1/2 or Gemini
    routing_skew: float = 1.0  # the hottest expert's tokens over the mean's, set on the moe_hybrid candidates
    expert_load: ExpertLoad | None = None  # a measured histogram instead: each ep size's hot-rank share (_expert_load)
    optimizer: Optimizer = Optimizer.ADAMW  # MUON: MuonWithAdamW, only on the layouts cx steps it on


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_reason(shape: ModelShape, tp: int) -> str | None:
    for name, value in (
        ("attention heads", shape.num_heads),
        ("key/value heads", shape.num_kv_heads),
        ("MLP width", shape.intermediate_size),
    ):
        if value % tp:
            return f"tp={tp} does not divide the {value} {name}"
    return None


def _sp_options(shape: ModelShape, tp: int, sp: int, seq_len: int) -> Iterator[tuple[str | None, int]]:
    """(sp_mode, sp axis size) pairs that run with this tp and sp axis size."""
    if sp == 1:
        yield None, 1
        if tp > 1 and seq_len % tp == 0:
            yield "split_gather", 1
        return
    heads, kv = shape.num_heads // tp, shape.num_kv_heads // tp
    if heads % sp == 0 and kv % sp == 0 and seq_len % sp == 0:
        yield "all_to_all", sp
    if seq_len % (2 * sp) == 0:
        yield "ring_attn", sp


def _batches(per_rank: int, pp: int) -> Iterator[tuple[int, int]]:
    """(micro_batch_size, num_microbatches) splits of one dp rank's sequences."""
    for micro in _divisors(per_rank):
        count = per_rank // micro
        if pp == 1 or count >= pp:
            yield micro, count


def _data_parallel(plugin: str, world: int, per_rank: int, space: SearchSpace, why: set[str]) -> Iterator[Candidate]:
    """The data-parallel plugins checkpoint all layers or none (transformers' switch), and Gemini runs one
    micro-batch per step (its GeminiDDP refuses accumulation as cx-train configures it)."""
    states = space.optimizer_states_dtype if plugin in ("low_level_zero", "gemini") else "fp32"
    base = Candidate(
        plugin, dp=world, precision=space.precision, optimizer_states_dtype=states, optimizer=space.optimizer
    )
    variants = [base]
    if plugin == "low_level_zero":
        variants = [dataclasses.replace(base, zero_stage=stage) for stage in (1, 2)]
    elif plugin == "torch_fsdp":  # each decoder layer its own unit (cx-train's), and ColossalAI's one root unit
        variants = [dataclasses.replace(base, fsdp_wrap="block"), base]
    elif plugin == "gemini":
        offloaded = dataclasses.replace(base, offload_optim_frac=1.0)
        variants = [base, offloaded, dataclasses.replace(base, placement_policy="auto")]
    settings = [(r, "full") for r in space.checkpoint_ratios if r in (0.0, 1.0)]
    settings += [(1.0, mode) for mode in space.checkpoint_modes if mode != "full"]
    if not settings:
        why.add(f"it checkpoints all layers or none, not a ratio of {', '.join(map(str, space.checkpoint_ratios))}")
    batches = [(micro, count) for micro, count in _batches(per_rank, 1) if plugin != "gemini" or count == 1]
    for variant, (ratio, mode), (micro, count) in itertools.product(variants, settings, batches):
        yield dataclasses.replace(
            variant, micro_batch_size=micro, num_microbatches=count, checkpoint_ratio=ratio, checkpoint_mode=mode
        )


def _gemini_tp(
    shape: ModelShape, world: int, global_batch: int, space: SearchSpace, why: set[str]
) -> Iterator[Candidate]:
    """GeminiPlugin at tp_size > 1: ShardFormer over tp, Gemini's layouts over the dp = world / tp ranks left."""
    if space.optimizer is Optimizer.MUON:
        return  # said once by `optimizer_skips`
    for tp in (tp for tp in _divisors(world)[1:] if tp <= space.max_tp):
        reason, dp = _tp_reason(shape, tp), world // tp
        if reason is None and global_batch % dp:
            reason = f"the global batch {global_batch} does not split over dp={dp}"
        if reason:
            why.add(reason)
            continue
        for candidate in _data_parallel("gemini", dp, global_batch // dp, space, why):
            if candidate.checkpoint_mode == "full":  # the op policy does not wrap ShardFormer's tp layers
                yield dataclasses.replace(candidate, tp=tp)


def _parallel(
    plugin: str, shape: ModelShape, world: int, global_batch: int, seq_len: int, space: SearchSpace, why: set[str]
) -> Iterator[Candidate]:
    for tp, pp in itertools.product(_divisors(world), _divisors(world)):
        if tp > space.max_tp or pp > space.max_pp or world % (tp * pp):
            continue
        reason = _tp_reason(shape, tp)
        if pp > shape.num_layers:
            reason = f"pp={pp} exceeds the {shape.num_layers} layers"
        if reason:
            why.add(reason)
            continue
        for sp in _divisors(world // (tp * pp)):
            dp = world // (tp * pp * sp)
            if global_batch % dp:
                why.add(f"the global batch {global_batch} does not split over dp={dp}")
                continue
            experts = [1]
            if plugin == "moe_hybrid":
                experts = [ep for ep in _divisors(dp) if shape.num_experts % ep == 0]
            for (mode, sp_size), ep in itertools.product(_sp_options(shape, tp, sp, seq_len), experts):
                yield from _pipelines(plugin, shape, dp, tp, pp, sp_size, mode, ep, global_batch // dp, space)


def _pipelines(
    plugin: str, shape: ModelShape, dp: int, tp: int, pp: int, sp: int, mode: str | None, ep: int, per_rank: int,
    space: SearchSpace,
) -> Iterator[Candidate]:  # fmt: skip
    styles = ["1f1b"]  # with pp 1 the style is moot; two-chunk styles need two layers per stage
    if pp > 1:
        styles = [s for s in space.pp_styles if s == "1f1b" or shape.num_layers >= 2 * pp]
    for style in styles:
        for (micro, count), stage, ratio in itertools.product(
            _batches(per_rank, pp), (0, 1, 2), space.checkpoint_ratios
        ):
            if style == "interleaved" and count % pp:
                continue
            yield Candidate(
                plugin, dp=dp, tp=tp, pp=pp, sp=sp, sp_mode=mode, ep=ep, zero_stage=stage, micro_batch_size=micro,
                num_microbatches=count, pp_style=style, checkpoint_ratio=ratio, precision=space.precision,
                optimizer_states_dtype=space.optimizer_states_dtype if stage >= 1 else "fp32",
                routing_skew=_routing_skew(space, plugin, ep), optimizer=space.optimizer,
            )  # fmt: skip


def _routing_skew(space: SearchSpace, plugin: str, ep: int) -> float:
    if plugin != "moe_hybrid":
        return 1.0
    return space.routing_skew if space.expert_load is None else space.expert_load.hot_rank_share(ep)


def _check_expert_load(space: SearchSpace, shape: ModelShape) -> None:
    load = space.expert_load
    if load is None:
        return
    if space.routing_skew != 1:
        raise ValueError("give the routing either as --routing-skew or as --expert-load, not both")
    if load.num_experts != shape.num_experts:
        raise ValueError(
            f"the expert load ({load.source}) counts {load.num_experts} experts per layer, the model has "
            f"{shape.num_experts}: measure it on the model being planned"
        )


def enumerate_candidates(
    shape: ModelShape, world: int, seq_len: int, space: SearchSpace | None = None
) -> list[Candidate]:
    """Every configuration of `space.plugins` for `world` ranks training `shape` on sequences of `seq_len` tokens."""
    space = SearchSpace() if space is None else space
    if not space.routing_skew >= 1:
        raise ValueError(f"routing_skew must be >= 1 (1: balanced routing), got {space.routing_skew}")
    _check_expert_load(space, shape)
    if world < 1:
        raise NoLayoutError(f"the world size must be a positive number of devices, got {world}")
    unknown = [p for p in space.plugins if p not in PLUGINS]
    if unknown:
        raise NoLayoutError(f"unknown plugin(s) {', '.join(unknown)}; choose from {', '.join(PLUGINS)}")
    if space.optimizer is Optimizer.MUON and space.optimizer_states_dtype != "fp32":
        raise ValueError(
            f"optimizer states dtype {space.optimizer_states_dtype} stores Adam's moments with stochastic rounding; "
            "optimizer muon keeps fp32 states (cx-train refuses the pair)"
        )
    global_batch = 4 * world if space.global_batch is None else space.global_batch
    found: list[Candidate] = []
    reasons: dict[str, set[str]] = {}
    for plugin in space.plugins:
        why = reasons.setdefault(plugin, set())
        if plugin == "moe_hybrid" and not shape.num_experts:
            why.add(f"{shape.name} has no routed experts")
            continue
        if plugin in ("hybrid", "moe_hybrid"):
            found += _parallel(plugin, shape, world, global_batch, seq_len, space, why)
        elif global_batch % world:
            why.add(f"the global batch {global_batch} does not split over dp={world}")
        else:
            found += _data_parallel(plugin, world, global_batch // world, space, why)
        if plugin == "gemini":
            found += _gemini_tp(shape, world, global_batch, space, why)
    if not space.checkpoint_ratios:
        for plugin in ("hybrid", "moe_hybrid"):
            reasons.get(plugin, set()).add("ShardFormer checkpoints a ratio of whole layers; no ratio was given")
    if not found:
        lines = "; ".join(f"{p}: {', '.join(sorted(r)) or 'no layout'}" for p, r in reasons.items())
        raise NoLayoutError(
            f"no configuration splits {world} ranks for {shape.name} (global batch {global_batch}): {lines}"
        )
    return found


def optimizer_skips(space: SearchSpace, shape: ModelShape, world: int) -> tuple[str, ...]:
    """The layouts of `space` left out for its optimizer, one line each, said once in the report rather than once per
    candidate: Gemini at tp > 1 under Muon (cx steps it; cx-plan does not model its owners over dp and tp), said only
    where `world` ranks of `shape` would have given a Gemini tp > 1 layout under AdamW."""
    if space.optimizer is not Optimizer.MUON or "gemini" not in space.plugins or space.max_tp == 1:
        return ()
    global_batch = 4 * world if space.global_batch is None else space.global_batch
    adamw = dataclasses.replace(space, optimizer=Optimizer.ADAMW)
    if next(_gemini_tp(shape, world, global_batch, adamw, set()), None) is None:
        return ()
    return (
        "not considered under --optimizer muon: gemini at tp > 1 (cx steps it, but cx-plan does not model its owners "
        "over dp and tp)",
    )
