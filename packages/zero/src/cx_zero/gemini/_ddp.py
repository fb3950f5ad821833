"""`GeminiDDP`: chunk-based ZeRO-3 data parallelism for any `nn.Module` (ColossalAI's constructor arguments).

Construction casts the parameters to `mixed_precision`, packs the trainable ones into the chunk group "param" and
the frozen ones into "frozen" (never reduced, no master) with the parameters of long-lived units (the model's root:
embedding, final norm) in chunks of their own, closes the groups (each rank keeps its own slices),
creates fp32 master chunks for low-precision parameters and gradient chunks at the placement policy's optimizer
residence, and installs the module-granularity hooks of `GeminiDriver`. Parameters keep their identity: their
`.data` points into a gathered chunk while used and at empty storage otherwise. Buffers stay ordinary module
buffers on the compute device, broadcast from rank 0 at wrap time and updated by each rank on its own afterwards
(docs/gemini.md, Buffers). `chunk_init_device` only says where chunks are built; they compute on the accelerator.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from cx_chunk import (
    AutoPlacementPolicy,
    Chunk,
    ChunkConfig,
    ChunkManager,
    ChunkScheduler,
    MemStats,
    PlacementPolicy,
    StaticPlacementPolicy,
    search_chunk_configuration,
)
from cx_mesh import ProcessGroup, communication_device, get_accelerator, get_dist_logger, require_initialized
from cx_zero._pick import pick_options
from cx_zero.gemini import _state
from cx_zero.gemini._driver import GeminiDriver
from cx_zero.gemini._gather import full_chunk
from cx_zero.gemini._options import GeminiOptions, PlacementKind
from cx_zero.gemini._outputs import map_tensors
from cx_zero.gemini._source import ParameterSource
from cx_zero.gemini._units import build_units, long_lived_params, parameter_names

__all__ = ["GeminiDDP"]


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class GeminiDDP(nn.Module):
    """Wrap `module` for chunk-based ZeRO-3 (argument meanings in docs/gemini.md). ColossalAI's option keywords, or
    `options=` a `GeminiOptions` group built once elsewhere (GeminiPlugin does), not both."""

    def __init__(
        self,
        module: nn.Module,
        chunk_config_dict: Mapping[Any, Any] | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        mixed_precision: torch.dtype = torch.float16,
        zero_group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        memstats: MemStats | None = None,
        master_weights: bool = True,
        enable_async_reduce: bool = True,
        verbose: bool = False,
        scatter_after_inference: bool = True,
        fp8_communication: bool = False,
        *,
        options: GeminiOptions | None = None,
        parameter_source: ParameterSource | None = None,
    ) -> None:
        require_initialized("GeminiDDP")
        if not scatter_after_inference:
            warnings.warn(
                "GeminiDDP(scatter_after_inference=False) has no effect in cx: chunks gathered by a no-grad forward "
                "are released after it as with True (results are the same; only re-gathering is saved in ColossalAI)",
                stacklevel=2,
            )
        from_keywords = GeminiOptions.from_arguments(
            chunk_config_dict,
            chunk_init_device,
            placement_policy,
            enable_gradient_accumulation,
            max_prefetch,
            shard_param_frac,
            offload_optim_frac,
            offload_param_frac,
            warmup_non_model_data_ratio,
            steady_cuda_cap_ratio,
            search_range_m,
            hidden_dim,
            min_chunk_size_m,
            pin_memory,
            force_outputs_fp32,
            strict_ddp_mode,
            mixed_precision,
            master_weights,
            enable_async_reduce,
            fp8_communication,
        )
        options = pick_options(options, from_keywords, GeminiOptions.from_arguments(), "GeminiDDP")
        if not isinstance(module, nn.Module):
            raise TypeError(f"GeminiDDP: module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, GeminiDDP) or getattr(module, "_cx_gemini_wrapped", False):
            raise ValueError("GeminiDDP: this module is already wrapped by a GeminiDDP")
        chunk_init_device = options.chunk_init_device
        mixed_precision = options.mixed_precision
        super().__init__()
        self.module = module
        self.options = options
        self.zero_group = zero_group
        self.extra_dp_group = extra_dp_group
        # as in ColossalAI, chunk_init_device only says where chunks are built (the CPU spares the accelerator the
        # whole model during construction); they live and compute on the accelerator
        self.compute_device = torch.device(get_accelerator().current_device())
        self.chunk_init_device = (
            torch.device(chunk_init_device) if chunk_init_device is not None else self.compute_device
        )
        if self.chunk_init_device.type not in ("cpu", self.compute_device.type):
            raise ValueError(
                f"GeminiDDP: chunk_init_device must be the CPU or the accelerator ({self.compute_device}), got "
                f"{self.chunk_init_device}"
            )
        group_size = dist.get_world_size(zero_group)

        sparse = [n for n, m in module.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        if sparse:
            raise NotImplementedError(
                f"GeminiDDP: sparse gradients are not supported (chunks hold dense gradients); modules {sparse} "
                "have sparse=True: build them with sparse=False"
            )
        all_names = parameter_names(module)
        params = list({id(p): p for p in module.parameters()}.values())
        if not params:
            raise ValueError("GeminiDDP: the module has no parameters")
        bad = [all_names[id(p)][0] for p in params if not p.is_floating_point()]
        if bad:
            raise TypeError(f"GeminiDDP: non-floating-point parameters cannot be trained in chunks: {bad}")
        self.param_names: dict[int, str] = {id(p): all_names[id(p)][0] for p in params}
        self.all_param_names = all_names
        self.original_dtypes: dict[int, torch.dtype] = {id(p): p.dtype for p in params}
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        lazy = {id(p) for p in params if p.is_meta}
        if lazy and parameter_source is None:
            raise ValueError(
                f"GeminiDDP: parameters on the meta device ({[self.param_names[i] for i in list(lazy)[:3]]}, ...) "
                "have no values: build the model under cx_plugins.LazyInitContext and boost it (or pass "
                "parameter_source=), or materialise it first"
            )
        if not trainable:
            raise ValueError("GeminiDDP: no parameter requires grad; there is nothing to train")

        units = build_units(module)
        if options.chunk_config is not None:
            given = options.chunk_config
            config = ChunkConfig(
                -(-given.chunk_size // group_size) * group_size, given.keep_gathered, given.separate_above
            )
            if options.strict_ddp_mode and not config.keep_gathered:
                config = ChunkConfig(config.chunk_size, True, config.separate_above)
            apart = [] if config.keep_gathered else long_lived_params(units, config.chunk_size)
        else:

            def search(candidates: list[nn.Parameter]) -> ChunkConfig:
                return search_chunk_configuration(
                    candidates,
                    options.search_range_m,
                    min_chunk_size_m=options.min_chunk_size_m,
                    hidden_dim=options.hidden_dim,
                    group_size=group_size,
                ).config

            config = search(trainable)
            apart = [] if config.keep_gathered else long_lived_params(units, config.chunk_size)
            if apart:  # size the chunks for the stream that is packed by size: without the set-apart parameters
                apart_ids = {id(p) for p in apart}
                stream = [p for p in trainable if id(p) not in apart_ids]
                refined = search(stream) if stream else config
                config = config if refined.keep_gathered else refined
            if options.strict_ddp_mode:
                config = ChunkConfig(config.chunk_size, True, config.separate_above)
                apart = []
        self.chunk_config = config

        originals = (
            {id(p): p.detach().to("cpu", torch.float32, copy=True) for p in trainable if id(p) not in lazy}
            if options.needs_master
            else {}
        )
        self.manager = ChunkManager(
            config,
            group=zero_group,
            extra_dp_group=extra_dp_group,
            compute_device=self.compute_device,
            init_device=self.chunk_init_device,
            pin_memory=options.pin_memory,
            fp8_communication=options.fp8_communication,
        )
        for p in params:  # a meta parameter stays there until its chunk slot receives its value
            p.data = p.data.to(p.device if id(p) in lazy else self.chunk_init_device, mixed_precision)
        for group_name, wanted in (("param", True), ("frozen", False)):
            together = [p for p in apart if p.requires_grad is wanted]
            if together:
                self.manager.register_apart(together, group_name, names=[self.param_names[id(p)] for p in together])
        set_apart = {id(p) for p in apart}
        for p in params:
            if id(p) not in set_apart:
                self.manager.register_tensor(p, "param" if p.requires_grad else "frozen", name=self.param_names[id(p)])
        self.manager.close_all_groups()
        if options.needs_master:
            self.manager.create_master_chunks("param", torch.float32)
            self._load_master_values(originals)
        del originals
        if parameter_source is not None:
            self._receive_lazy(parameter_source, lazy)
        # floating buffers compute in the parameters' dtype (an fp32 buffer would promote bf16 activations to fp32
        # and the next low-precision layer would refuse them); state dicts give them back in their own dtype
        self.buffer_dtypes: dict[int, torch.dtype] = {}
        for buffer_owner in module.modules():
            for name, buf in buffer_owner.named_buffers(recurse=False):
                if buf is not None:
                    if buf.is_meta:
                        raise ValueError(f"GeminiDDP: buffer {name!r} is still on the meta device after materialising")
                    dtype = mixed_precision if buf.is_floating_point() else buf.dtype
                    moved = buf.to(self.compute_device, dtype)
                    self.buffer_dtypes[id(moved)] = buf.dtype
                    setattr(buffer_owner, name, moved)
        self._sync_replicas()
        policy: PlacementPolicy
        if options.placement is PlacementKind.STATIC:
            policy = StaticPlacementPolicy(
                options.shard_param_frac, options.offload_optim_frac, options.offload_param_frac
            )
        else:
            policy = AutoPlacementPolicy(options.warmup_non_model_data_ratio, options.steady_cuda_cap_ratio)
        self.policy = policy
        self.scheduler = ChunkScheduler(self.manager, policy, max_prefetch=options.max_prefetch, memstats=memstats)
        for chunk in self.manager.chunks("param"):
            self.manager.grad_chunk(chunk, policy.optimizer_residence(chunk))

        check_groups = [zero_group] + ([extra_dp_group] if extra_dp_group is not None else [])
        self.driver = GeminiDriver(
            self.manager,
            self.scheduler,
            units,
            self.param_names,
            check_groups=check_groups,
            eager_reduce=options.enable_async_reduce,
            allow_accumulation=options.enable_gradient_accumulation,
        )
        self.driver.install()
        module._cx_gemini_wrapped = True  # type: ignore[assignment]
        if verbose:
            get_dist_logger("cx_zero.gemini").info(
                f"GeminiDDP: {len(trainable)} trainable + {len(frozen)} frozen parameters in "
                f"{len(self.manager.chunks())} chunks of {config.chunk_size} elements "
                f"(keep_gathered={config.keep_gathered}), placement {options.placement.value}",
                ranks=[0],
            )

    # --------------------------------------------------------------------------------------------- running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            # chunk buffers made under inference mode would be inference tensors, unusable by later training
            # steps: gather and compute outside it, still without autograd
            with torch.inference_mode(False), torch.no_grad():
                return self._forward(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        self.driver.begin_forward()
        try:
            args, kwargs = _cast_floats((args, kwargs), self.options.mixed_precision)
            output = self.module(*args, **kwargs)
        except BaseException as error:
            self.driver.abandon_forward()
            if isinstance(error, RuntimeError) and "0" in str(error):
                error.add_note(
                    "GeminiDDP: parameters are gathered per module (its own and its direct children's parameters); "
                    "a parameter read from anywhere else is an empty tensor. If a shape above is 0, call the module "
                    "that owns the parameter (or its parent) instead of reading the parameter directly."
                )
            raise
        self.driver.end_forward(output)
        if self.options.force_outputs_fp32:
            output = _cast_floats(output, torch.float32)
        return output

    def backward(self, loss: torch.Tensor) -> None:
        """Run backward; gradients land in gradient chunks, reduced over the zero group chunk by chunk."""
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient chunks (parameters never hold `.grad`)."""
        self.driver.zero_grad()

    def unwrap(self) -> nn.Module:
        """The wrapped module (its parameters are still sharded: read full values through `state_dict`)."""
        return self.module

    # ------------------------------------------------------------------------------------------- state dict
    def state_dict(  # type: ignore[override]
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False, *, only_rank_0: bool = True
    ) -> dict[str, torch.Tensor]:
        """Full tensors (original dtype, CPU) by name, tied parameters under every name; collective.

        With `only_rank_0=True` only rank 0 of the group(s) gets them (the others get an empty dict).
        """
        if destination is not None or keep_vars:
            raise NotImplementedError("GeminiDDP.state_dict: destination and keep_vars are not supported")
        out: dict[str, torch.Tensor] = {}
        for shard, _ in _state.state_dict_shard(self, prefix, 0, only_rank_0):
            out.update(shard)
        return out

    def state_dict_shard(
        self, prefix: str = "", max_shard_size: int = 1024 * 1024 * 1024, only_rank_0: bool = True
    ) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
        """Stream the state dict as (tensors, bytes) pieces of about `max_shard_size` bytes; collective."""
        return _state.state_dict_shard(self, prefix, max_shard_size, only_rank_0)

    def load_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load full tensors by name; each rank keeps its own part (every rank passes the full dict)."""
        if assign:
            raise NotImplementedError("GeminiDDP.load_state_dict: assign=True is not supported")
        missing, unexpected = _state.load_full(self, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    # cx-checkpoint protocols ------------------------------------------------------------------------------
    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """`TensorSource`: rank 0 of the group yields the full tensors; every rank must iterate (collective)."""
        for shard, _ in _state.state_dict_shard(self, "", max_bytes, True):
            if shard:
                yield shard

    def expected_tensors(self) -> Mapping[str, Any]:
        """`TensorSink`: every name with its full shape and dtype."""
        return _state.expected(self)

    def owned_region(self, name: str) -> None:
        """`TensorSink`: the whole tensor is read; each rank keeps the flat range its chunks own."""
        return None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """`TensorSink`: take one full tensor."""
        _state.load_full(self, {name: tensor}, strict=False)

    # ------------------------------------------------------------------------------------------- accounting
    def chunk_memory(self) -> dict[str, int]:
        """Resident chunk bytes on this rank (parameter, master, gradient) and the gathered parameter total."""
        usage = self.manager.usage
        return {
            "device": usage.device,
            "host": usage.host,
            "gathered_param_bytes": sum(c.nbytes for c in self.manager.chunks()),
        }

    # -------------------------------------------------------------------------------------------- internals
    def _sync_replicas(self) -> None:
        """Make every replica identical, as DDP does: what each rank of the zero group keeps in full (buffers and
        keep_gathered chunks, with their masters) is broadcast from its rank 0; sharded chunks need nothing there
        (each element has exactly one owner in the zero group). Over `extra_dp_group` every rank with the same zero
        rank holds the same slices, so all of them (sharded chunks and masters too) are broadcast from its rank 0."""
        buffers = list(self.module.buffers())
        zero_tensors = buffers + self._chunk_shards(lambda chunk: chunk.keep_gathered)
        _broadcast(zero_tensors, self.zero_group)
        if self.extra_dp_group is not None:
            _broadcast(buffers + self._chunk_shards(lambda chunk: True), self.extra_dp_group)

    def _chunk_shards(self, select: Callable[[Chunk], bool]) -> list[torch.Tensor]:
        """This rank's slice of every selected chunk and of its master chunk."""
        tensors = []
        for chunk in self.manager.chunks():
            if select(chunk):
                tensors.append(chunk.shard_tensor())
                if chunk.paired is not None:
                    tensors.append(self.manager.master_chunk(chunk).shard_tensor())
        return tensors

    def _receive_lazy(self, source: ParameterSource, lazy: set[int]) -> None:
        """Take the meta parameters' values from `source` one at a time, each straight into this rank's part of its
        chunk and master chunk: a full parameter exists only while it is being copied (never the whole model)."""
        received: set[int] = set()

        def receive(param: nn.Parameter, value: torch.Tensor) -> None:
            name = self.param_names.get(id(param), tuple(param.shape))
            if id(param) not in lazy or id(param) in received:
                raise ValueError(f"GeminiDDP: the parameter source gave {name!r} a value it does not need (again)")
            if tuple(value.shape) != tuple(self.manager.get_chunk(param).slot(param).shape):
                raise ValueError(f"GeminiDDP: the parameter source gave {name!r} a value of shape {tuple(value.shape)}")
            received.add(id(param))
            _state.write_parameter(self, param, value.detach())

        source.stream(receive)
        missing = [self.param_names[i] for i in lazy - received]
        if missing:
            raise ValueError(f"GeminiDDP: the parameter source gave no value to {missing[:5]}")

    def _load_master_values(self, values: Mapping[int, torch.Tensor]) -> None:
        """Write fp32 values (by parameter id, full tensors) into this rank's part of the master chunks."""
        for chunk in self.manager.chunks("param"):
            _state.write_own_slices(self.manager.master_chunk(chunk), chunk, values)

    def _named_full_tensors(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, full value in its original dtype on CPU), chunk by chunk; collective over the zero group."""
        for chunk in self.manager.chunks():
            source: Chunk = chunk
            if chunk.paired is not None:
                source = self.manager.master_chunk(chunk)
            full = full_chunk(source)
            for tensor, slot in zip(chunk.tensors, chunk.slots, strict=True):
                value = full[slot.begin : slot.end].view(slot.shape).to(self.original_dtypes[id(tensor)])
                yield tensor, value  # type: ignore[misc]


def _broadcast(tensors: list[torch.Tensor], group: ProcessGroup | None) -> None:
    """Overwrite `tensors` with rank 0 of `group`'s values (staged through the group's communication device)."""
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    device = communication_device(group)
    for tensor in tensors:
        staged = tensor.to(device)
        dist.broadcast(staged, source, group=group)
        if staged is not tensor:
            tensor.copy_(staged)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors anywhere in `value` (pytree structures and dataclasses) cast to `dtype`."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, value)
