"""Point-to-point transport between pipeline stages: pytree values, a metadata cache, and in-order channels.

Every rank knows every stage's action list, hence the exact order in which each neighbour sends it messages. A
receiver takes messages from a neighbour strictly in that order, keeping any that arrive ahead of the one it needs
(`_inbox`). The order on each (sender, receiver) channel is therefore identical on both ends, which is what NCCL
needs (it matches point-to-point operations by order, ignoring tags); gloo is satisfied too. Sends are asynchronous
(`isend`) and are waited for at the end of the step, so a sender never blocks on its receiver.

Activation messages carry their tensors only: shapes, dtypes and structure (`TreeMeta`) were exchanged once by the
probe forward and are cached per virtual stage. With `enable_metadata_cache=False` every activation message is
preceded by its metadata. Gradient messages never need metadata: a gradient has the shape of the activation sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import communication_device
from cx_pipeline._actions import Action, ActionKind
from cx_pipeline._pytree import TreeMeta, flatten, unflatten

__all__ = ["Message", "StageTransport"]

Message = tuple[str, int, int]  # ("act" | "grad", destination virtual stage, micro-batch)
Posted = tuple[Message, list[dist.Work], list[torch.Tensor], TreeMeta | None]
#: Receives kept posted ahead of need per neighbour: two lets a neighbour's back-to-back messages (interleaved
#: warm-up, an activation right after a gradient) both move while this rank computes.
RECV_WINDOW = 2
_STATUS_OK = 0
_STATUS_ERROR = 1


def outgoing(action: Action, num_virtual: int, host: Callable[[int], int]) -> tuple[int, Message] | None:
    """(destination stage, message) that `action` sends to another stage, or None (nothing or a local hand-off)."""
    v, mb = action.virtual_stage, action.microbatch
    if action.kind is ActionKind.FORWARD and v + 1 < num_virtual:
        return host(v + 1), ("act", v + 1, mb)
    if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and v > 0:
        return host(v - 1), ("grad", v - 1, mb)
    return None


class StageTransport:
    """Sends and receives the activations and gradients of one rank for one step's schedule."""

    def __init__(
        self,
        stage_ranks: list[int],
        stage: int,
        group: dist.ProcessGroup,
        enable_metadata_cache: bool,
        overlap: bool = True,
    ) -> None:
        self._ranks = stage_ranks
        self._stage = stage
        self._group = group
        self.device = communication_device(group)
        self.enable_metadata_cache = enable_metadata_cache
        #: Post receives ahead of need (`overlap_p2p=True`); otherwise each is posted and waited for when needed.
        self.overlap = overlap
        self.act_meta: dict[int, TreeMeta] = {}  # destination virtual stage -> metadata of what it receives
        self._expected: dict[int, list[Message]] = {}
        self._inbox: dict[Message, Any] = {}
        self._sent_like: dict[Message, list[torch.Tensor]] = {}  # act message -> tensors whose grads come back
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._posted: dict[int, list[Posted]] = {}  # per neighbour, in its sending order

    # ---- per-step plan --------------------------------------------------------------------------------------------
    def plan(self, orders: list[list[Action]], num_virtual: int, host: Callable[[int], int]) -> None:
        """Record, for every neighbour, the order in which it will send this rank messages this step."""
        self._expected = {}
        for stage, actions in enumerate(orders):
            if stage == self._stage:
                continue
            for action in actions:
                sent = outgoing(action, num_virtual, host)
                if sent is not None and sent[0] == self._stage:
                    self._expected.setdefault(stage, []).append(sent[1])
        self._inbox = {}
        self._sent_like = {}

    # ---- sending --------------------------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.detach().to(self.device).contiguous()
        work = dist.isend(tensor, self._ranks[stage], group=self._group)
        assert work is not None
        self._pending.append((work, tensor))

    def _send_bytes(self, status: int, data: bytes, stage: int) -> None:
        self._isend(torch.tensor([status, len(data)], dtype=torch.int64), stage)
        if data:
            self._isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), stage)

    def send_activation(self, stage: int, message: Message, value: Any) -> None:
        leaves, meta = flatten(value, f"the output of virtual stage {message[1] - 1}")
        if not self.enable_metadata_cache:
            self._send_bytes(_STATUS_OK, meta.to_bytes(), stage)
        for leaf in leaves:
            self._isend(leaf, stage)
        self.remember_sent(("grad", message[1] - 1, message[2]), leaves)

    def remember_sent(self, message: Message, leaves: list[torch.Tensor]) -> None:
        """Gradients come back for the floating-point leaves sent forward (zeros where the receiver did not use one)."""
        self._sent_like[message] = [leaf for leaf in leaves if leaf.is_floating_point()]

    def send_grads(self, stage: int, grads: list[torch.Tensor]) -> None:
        for grad in grads:
            self._isend(grad, stage)

    def grads_like(self, message: Message) -> list[torch.Tensor]:
        """The tensors whose gradients `message` ("grad", v, mb) carries: what this rank sent forward for (v+1, mb)."""
        return self._sent_like[message]

    def prune(self) -> None:
        """Drop finished sends (their buffers) so memory does not grow over a step."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def wait_all(self) -> None:
        """Wait for every send issued so far."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def end_step(self) -> None:
        self.wait_all()
        if any(self._posted.values()) or any(self._expected.values()):
            raise RuntimeError(f"stage {self._stage} ended a step with messages still expected: {self._expected}")
        self._sent_like = {}
        self._inbox = {}

    # ---- receiving ------------------------------------------------------------------------------------------------
    def _recv(self, like: torch.Tensor | tuple[tuple[int, ...], torch.dtype], stage: int) -> torch.Tensor:
        if isinstance(like, torch.Tensor):
            buffer = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        else:
            buffer = torch.empty(like[0], dtype=like[1], device=self.device)
        dist.recv(buffer, self._ranks[stage], group=self._group)
        return buffer

    def _recv_bytes(self, stage: int) -> tuple[int, bytes]:
        header = self._recv(((2,), torch.int64), stage)
        status, size = int(header[0]), int(header[1])
        data = bytes(self._recv(((size,), torch.uint8), stage).tolist()) if size else b""
        return status, data

    def _recv_value(self, meta: TreeMeta, stage: int) -> Any:
        leaves = []
        for leaf in meta.leaves:
            tensor = self._recv((leaf.shape, leaf.dtype), stage)
            if leaf.requires_grad:
                tensor.requires_grad_(True)
            leaves.append(tensor)
        return unflatten(meta, leaves)

    def _post(self, stage: int) -> None:
        """Post the receives of the next messages from `stage` ahead of need (up to `RECV_WINDOW` per neighbour, in
        its sending order), so their transfer overlaps this rank's compute: gloo and NCCL move the data once the
        receive is posted, and both match receives from one peer in the order they were posted."""
        queue = self._expected.get(stage)
        posted = self._posted.setdefault(stage, [])
        while self.overlap and queue and len(posted) < RECV_WINDOW:
            message = queue[0]
            kind, virtual, _ = message
            if kind == "act":
                if not self.enable_metadata_cache:
                    return  # its metadata comes first, in the message itself
                meta: TreeMeta | None = self.act_meta[virtual]
                assert meta is not None
                shapes = [(leaf.shape, leaf.dtype) for leaf in meta.leaves]
            elif message in self._sent_like:
                meta = None
                shapes = [(tuple(t.shape), t.dtype) for t in self._sent_like[message]]
            else:
                return  # a gradient for an activation not sent yet: its shapes are not known
            queue.pop(0)
            buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
            works = []
            for buffer in buffers:
                work = dist.irecv(buffer, self._ranks[stage], group=self._group)
                assert work is not None
                works.append(work)
            posted.append((message, works, buffers, meta))

    def prefetch(self) -> None:
        """Post the next receive from every neighbour that has one pending (see `_post`)."""
        for stage in self._expected:
            self._post(stage)

    def _take_next(self, stage: int) -> None:
        posted = self._posted.get(stage)
        if posted:
            message, works, buffers, meta = posted.pop(0)
            for work in works:
                work.wait()
            if meta is None:
                self._inbox[message] = buffers
            else:
                for buffer, leaf in zip(buffers, meta.leaves, strict=True):
                    buffer.requires_grad_(leaf.requires_grad)
                self._inbox[message] = unflatten(meta, buffers)
            self._post(stage)  # refill the window before the caller computes with this message
            return
        queue = self._expected.get(stage)
        if not queue:
            raise RuntimeError(f"stage {self._stage} expected no more messages from stage {stage} this step")
        message = queue.pop(0)
        kind, virtual, _ = message
        if kind == "act":
            if self.enable_metadata_cache:
                meta = self.act_meta[virtual]
            else:
                _, data = self._recv_bytes(stage)
                meta = TreeMeta.from_bytes(data)
            self._inbox[message] = self._recv_value(meta, stage)
        else:
            self._inbox[message] = [self._recv(like, stage) for like in self.grads_like(message)]

    def ready(self, stage: int, message: Message) -> bool:
        """Whether `message` from `stage` can be taken without waiting (already here, or its posted receive done)."""
        while message not in self._inbox:
            posted = self._posted.get(stage)
            if not posted or not all(work.is_completed() for work in posted[0][1]):
                return False
            self._take_next(stage)  # arrived: keep it (the window is refilled)
        return True

    def receive(self, stage: int, message: Message) -> Any:
        """The value of `message` from `stage`, receiving (and keeping) anything that stage sent before it."""
        while message not in self._inbox:
            self._take_next(stage)
        return self._inbox.pop(message)

    def deliver_locally(self, message: Message, value: Any) -> None:
        """A hand-off between two chunks on this rank: no communication, same bookkeeping."""
        self._inbox[message] = value

    def take_local(self, message: Message) -> Any:
        return self._inbox.pop(message)

    # ---- probe (first step): status + metadata + tensors -----------------------------------------------------------
    def probe_send(self, stage: int, value: Any | None, error: str | None) -> None:
        if error is not None:
            self._send_bytes(_STATUS_ERROR, error.encode(), stage)
            return
        leaves, meta = flatten(value)
        self._send_bytes(_STATUS_OK, meta.to_bytes(), stage)
        for leaf in leaves:
            self._isend(leaf, stage)

    def probe_receive(self, stage: int) -> tuple[Any, TreeMeta | None, str | None]:
        status, data = self._recv_bytes(stage)
        if status != _STATUS_OK:
            return None, None, data.decode()
        meta = TreeMeta.from_bytes(data)
        return self._recv_value(meta, stage), meta, None
