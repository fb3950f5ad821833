"""torch's Muon on FSDP2 shards: momentum on each rank's rows, Newton-Schulz on whole matrices at owner ranks.

FSDP2 holds each parameter as a DTensor sharded on dim 0 (rank r: rows [r * c, min((r + 1) * c, rows)), c the rows
divided by the group size rounded up, as `torch.chunk`). Muon's momentum, nesterov blend, learning-rate adjustment
and weight decay are elementwise, so they run on those rows exactly as on the whole matrix; only Newton-Schulz needs
the matrix whole. So `ShardedMuon` runs torch's own `Muon.step` (its hooks, closure, state init, lr-scheduler
bookkeeping) with its functional `torch.optim._muon.muon` replaced for the duration of the step by `_muon`, which
per param group:
1. updates the momentum on the shards (torch's lerp on the DTensors, state `momentum_buffer` sharded like the
   parameter, so checkpoints save and load it as AdamW's states);
2. gathers each matrix's blended update to its owner rank (`assign_owners`: balanced by Newton-Schulz cost, fixed
   at boost), one `gather` per owner, in bf16: Newton-Schulz rounds its input to bf16 first, so this is exact;
3. each owner runs torch's `_zeropower_via_newtonschulz` on its whole matrices (ranks work in parallel);
4. scatters each rank its rows of the result (bf16, as torch returns it), one `scatter` per owner;
5. applies torch's `_adjust_lr` (of the whole shape) and weight decay on the shards, as torch's `_single_tensor_muon`.
Parameters that are not DTensors (FSDP's ignored modules: whole on every rank) are stepped by every rank as torch
does. Patching the module global is not thread-safe: two Muon steps must not run at once in one process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import _to_scalar

from cx_mesh import ProcessGroup
from cx_zero import Spans, assign_owners, gather_to_owner, scatter_from_owner

__all__ = ["ShardedMuon", "sharded_muon_supported", "torch_muon_parts"]

_TORCH_PARTS = ("muon", "_zeropower_via_newtonschulz", "_adjust_lr")


def torch_muon_parts() -> bool:
    """Whether torch still has the parts of its Muon that `ShardedMuon` calls or replaces."""
    return all(hasattr(torch_muon, name) for name in _TORCH_PARTS)


def sharded_muon_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is torch's Muon itself (a subclass may step otherwise) and torch still has the parts
    `ShardedMuon` calls."""
    return type(optimizer) is torch.optim.Muon and torch_muon_parts()


def _row_spans(shape: torch.Size, size: int) -> Spans:
    """Each group rank's flat range of a matrix sharded on dim 0 as FSDP2 shards it (`torch.chunk`)."""
    rows, cols = shape[0], math.prod(shape[1:])
    chunk = -(-rows // size)
    return [(min(r * chunk, rows) * cols, min((r + 1) * chunk, rows) * cols) for r in range(size)]


class ShardedMuon:
    """The owners of a Muon optimizer's sharded matrices and its step on FSDP2 shards (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: ProcessGroup | None) -> None:
        self.optimizer = optimizer
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        sharded = [p for p in self._muon_params() if isinstance(p, DTensor)]
        for param in sharded:
            if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
                raise ValueError(
                    f"TorchFSDPPlugin with Muon: expected parameters sharded on dim 0 over a 1-D mesh, got placements "
                    f"{param.placements} on a {param.device_mesh.ndim}-D mesh"
                )
        matrices = [p for p in sharded if p.ndim == 2]  # a 3-D stack's rows are whole matrices: no owner needed
        owners = assign_owners([p.shape for p in matrices], self.size)
        self.owner = {id(p): owner for p, owner in zip(matrices, owners, strict=True)}

    def _muon_params(self) -> list[torch.Tensor]:
        """The parameters Muon steps: all of torch's Muon's (a subclass narrows them)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """torch's Muon functional replaced by the sharded step while the optimizer steps."""
        original = torch_muon.muon
        torch_muon.muon = self._muon
        try:
            yield
        finally:
            torch_muon.muon = original

    def _muon(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        muon_momentum_bufs: list[torch.Tensor],
        *,
        foreach: bool | None = None,
        lr: float | torch.Tensor,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        eps: float,
        adjust_lr_fn: str | None,
        has_complex: bool,
    ) -> None:
        """torch's `_single_tensor_muon` with Newton-Schulz on whole matrices at their owners."""
        if foreach:
            raise RuntimeError("Foreach is not supported for Muon yet")
        if has_complex:
            raise ValueError("Complex parameters are not supported")
        scalar_lr = float(_to_scalar(lr))
        updates = []
        for grad, buf in zip(grads, muon_momentum_bufs, strict=True):
            if grad.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if nesterov else buf)
        ns: dict[str, Any] = {"ns_coefficients": ns_coefficients, "ns_steps": ns_steps, "eps": eps}
        orthogonal = self._orthogonalise(params, updates, ns)
        for param, update in zip(params, orthogonal, strict=True):
            adjusted_lr = torch_muon._adjust_lr(scalar_lr, adjust_lr_fn, param.shape)
            param.mul_(1 - scalar_lr * weight_decay)
            param.add_(update, alpha=-adjusted_lr)

    def _orthogonalise(
        self, params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], ns: dict[str, Any]
    ) -> list[torch.Tensor]:
        """Newton-Schulz of each update: whole tensors locally; DTensors gathered to, computed at and scattered from
        their owners, returned as DTensors laid out as the parameter."""
        result: list[torch.Tensor | None] = [None] * len(updates)
        by_owner: list[list[int]] = [[] for _ in range(self.size)]
        for index, (param, update) in enumerate(zip(params, updates, strict=True)):
            if isinstance(update, DTensor):
                by_owner[self.owner[id(param)]].append(index)
            else:
                result[index] = torch_muon._zeropower_via_newtonschulz(update, **ns)
        spans = {i: _row_spans(updates[i].shape, self.size) for owned in by_owner for i in owned}
        wholes: list[torch.Tensor] = []
        for owner, owned in enumerate(by_owner):  # 2. every owner's whole updates (bf16: exact, see docstring)
            if not owned:
                continue
            local = [self._local(updates[i], spans[i]) for i in owned]
            gathered = gather_to_owner(self.group, owner, self.rank, [spans[i] for i in owned], local, torch.bfloat16)
            if gathered is not None:
                wholes = [full.view(updates[i].shape) for i, full in zip(owned, gathered, strict=True)]
        mine = by_owner[self.rank]  # 3. this rank's own matrices, while the others compute theirs
        computed = [torch_muon._zeropower_via_newtonschulz(whole, **ns) for whole in wholes]
        for owner, owned in enumerate(by_owner):  # 4. every rank's rows of every result
            if not owned:
                continue
            sent = computed if owner == self.rank else None
            pieces = scatter_from_owner(self.group, owner, self.rank, [spans[i] for i in owned], sent, torch.bfloat16)
            for i, piece in zip(owned, pieces, strict=True):
                update = updates[i]
                assert isinstance(update, DTensor)
                rows = piece.view(-1, *update.shape[1:]).to(update.to_local().device)
                result[i] = DTensor.from_local(
                    rows, update.device_mesh, update.placements, run_check=False, shape=update.shape,
                    stride=update.stride(),
                )  # fmt: skip
        assert len(computed) == len(mine)
        done = [r for r in result if r is not None]
        assert len(done) == len(updates)
        return done

    def _local(self, update: torch.Tensor, spans: Spans) -> torch.Tensor:
        """This rank's rows of `update`, checked against the layout `_row_spans` assumes."""
        assert isinstance(update, DTensor)
        local = update.to_local()
        begin, end = spans[self.rank]
        if local.numel() != end - begin:
            raise RuntimeError(
                f"TorchFSDPPlugin with Muon: this rank holds {tuple(local.shape)} of a {tuple(update.shape)} matrix, "
                f"not the {end - begin} elements of a torch.chunk row shard"
            )
        return local
