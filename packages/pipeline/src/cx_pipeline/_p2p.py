"""Point-to-point transport between pipeline stages: pytree values, a checked metadata cache, in-order channels.

Every rank knows every stage's action list, hence the exact order in which each neighbour sends it messages. A
receiver takes messages from a neighbour strictly in that order, keeping any that arrive ahead of the one it needs
(`_inbox`). The order on each (sender, receiver) channel is therefore identical on both ends, which is what NCCL
needs (it matches point-to-point operations by order, ignoring tags); gloo is satisfied too.

Transfers are posted with `dist.batch_isend_irecv`, as torch's and Megatron's pipelines do: the sends of one action
and the receives posted after it go out as one batch (one NCCL group), so two neighbours sending each other large
tensors at once cannot each block in a send whose matching receive sits behind the other's send. Sends are waited
for at the end of the step, so a sender never blocks on its receiver.

Activation messages are checked, not trusted: each starts with a 3-integer header (status, metadata size, CRC-32 of
the sender's metadata). The shapes, dtypes and structure (`TreeMeta`) are cached per edge by the probe; when an
output matches the cache (the usual case) only the header and the tensors travel, and the receiver verifies the
CRC against its own cache. When it does not (a stage whose output size depends on the data, a shrinking batch),
the sender says so in the header, sends tensors of the cached shapes that the receiver has already posted for
(zeros, discarded), then the new metadata and the real tensors; both ends then cache the new metadata. A receiver
posts nothing after an activation on a channel until it has read that activation's header. With
`enable_metadata_cache=False` every activation carries its metadata.

Settled edges (issue 37: no host read in the steady state): once an edge's metadata has not changed for
`SETTLE_STEPS` whole steps (counted alike on both ends, which see the same headers), its receiver stops reading the
header on the host: it posts the header and the cached-shape tensors ahead like any other message and checks the
header on the device (`torch._assert_async` against the header it expects; on the CPU that assert runs at once and a
mismatch is read and named as before). The sender of a settled edge whose output no longer matches the cache cannot
renegotiate (its receiver does not read the header): it raises a `PipelineConfigError` naming the old and new shapes,
and its receiver sees the peer fail. A probe (a changed batch) unsettles every edge.

Gradient messages need no header: a gradient has the shape of the activation it belongs to, which the receiving
stage sent.

With `fp8_communication` the floating tensors of activations (E4M3) and gradients (E5M2) travel as fp8 with their
scale (`cx_mesh.fp8.pack_fp8`'s message): one transfer per tensor as before, so the channel order, the headers and
the metadata cache are unchanged; the probe, run once to fill the cache, sends full precision.

Every wait is named (`_wait`): a neighbour that is stuck past the group's timeout gives a `CollectiveTimeoutError`,
one that failed a `PeerFailedError`, each naming the peer's stage and rank and the group.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import communication_device, named_collective
from cx_mesh.fp8 import E4M3, E5M2, pack_fp8, packed_fp8_nbytes, unpack_fp8
from cx_pipeline._actions import Action, ActionKind
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._pytree import TreeMeta, flatten, unflatten

__all__ = ["Message", "StageTransport"]

Message = tuple[str, int, int]  # ("act" | "grad", destination virtual stage, micro-batch)
#: Receives kept posted ahead of need per neighbour: two lets a neighbour's back-to-back messages (interleaved
#: warm-up, an activation right after a gradient) both move while this rank computes.
RECV_WINDOW = 2
_STATUS_OK = 0
_STATUS_ERROR = 1
_CACHED = 0  # activation header: the tensors follow the cached metadata
_NEW = 2  # activation header: cached-shape filler (if an edge has a cache), metadata bytes, then the tensors
#: dtypes that travel as fp8 under fp8_communication; others (token ids, masks, fp8 already) travel as they are
_COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Whole steps an edge's metadata must stay unchanged before its receiver stops reading headers on the host.
SETTLE_STEPS = 2


def _wire_spec(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """The (shape, dtype) of the buffer that carries a compressible tensor: the packed fp8 message."""
    numel = 1
    for size in shape:
        numel *= size
    return (packed_fp8_nbytes(numel),), torch.uint8


@dataclass(eq=False)
class _Handle:
    """One posted transfer; its works are known once its batch is issued. A backend that coalesces a batch into
    one work (NCCL) gives every transfer of the batch that work."""

    works: list[dist.Work] = field(default_factory=list)

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)


@dataclass(eq=False)
class _Posted:
    message: Message
    handles: list[_Handle]
    buffers: list[torch.Tensor]
    header: torch.Tensor | None  # an activation's header; None for a gradient
    settled: bool = False  # an activation on a settled edge: its header is checked on the device, not read


def outgoing(action: Action, num_virtual: int, host: Callable[[int], int]) -> tuple[int, Message] | None:
    """(destination stage, message) that `action` sends to another stage, or None (nothing or a local hand-off)."""
    v, mb = action.virtual_stage, action.microbatch
    if action.kind is ActionKind.FORWARD and v + 1 < num_virtual:
        return host(v + 1), ("act", v + 1, mb)
    if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and v > 0:
        return host(v - 1), ("grad", v - 1, mb)
    return None


def _crc(meta: TreeMeta) -> int:
    return zlib.crc32(meta.to_bytes())


def _shapes(meta: TreeMeta) -> str:
    return ", ".join(f"{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}" for leaf in meta.leaves)


class StageTransport:
    """Sends and receives the activations and gradients of one rank for one step's schedule."""

    def __init__(
        self,
        stage_ranks: list[int],
        stage: int,
        group: dist.ProcessGroup,
        enable_metadata_cache: bool,
        overlap: bool = True,
        fp8_communication: bool = False,
    ) -> None:
        self._ranks = stage_ranks
        self._stage = stage
        self._group = group
        self.device = communication_device(group)
        self.enable_metadata_cache = enable_metadata_cache
        #: Post receives ahead of need (`overlap_p2p=True`); otherwise each is posted and waited for when needed.
        self.overlap = overlap
        self.fp8_communication = fp8_communication  # activations and gradients as fp8 (`pack_fp8`)
        self.act_meta: dict[int, TreeMeta] = {}  # destination virtual stage -> cached metadata of what it receives
        self._sent_meta: dict[int, TreeMeta] = {}  # destination virtual stage -> cached metadata of what was sent
        self._expected: dict[int, list[Message]] = {}
        self._inbox: dict[Message, Any] = {}
        self._sent_like: dict[Message, list[torch.Tensor]] = {}  # act message -> tensors whose grads come back
        self._pending: list[tuple[_Handle, torch.Tensor]] = []
        self._posted: dict[int, list[_Posted]] = {}  # per neighbour, in its sending order
        self._ops: list[tuple[dist.P2POp, _Handle]] = []  # queued for the next batch
        # Settling (module doc): per edge (destination virtual stage), whole steps without a metadata change, as
        # a sender and as a receiver; the edges that changed this step; the header a settled receiver expects.
        self._send_stable: dict[int, int] = {}
        self._recv_stable: dict[int, int] = {}
        self._send_changed: set[int] = set()
        self._recv_changed: set[int] = set()
        self._expected_header: dict[int, torch.Tensor] = {}

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

    # ---- batching -------------------------------------------------------------------------------------------------
    def _queue(self, op: Callable[..., Any], tensor: torch.Tensor, stage: int) -> _Handle:
        handle = _Handle()
        self._ops.append((dist.P2POp(op, tensor, self._ranks[stage], self._group), handle))
        return handle

    def flush(self) -> None:
        """Issue every queued send and receive as one `batch_isend_irecv`."""
        if not self._ops:
            return
        ops, self._ops = self._ops, []
        works = dist.batch_isend_irecv([op for op, _ in ops])
        if len(works) == len(ops):  # one work per transfer (gloo)
            for (_, handle), work in zip(ops, works, strict=True):
                handle.works = [work]
        else:  # one work for the whole batch (a coalescing backend)
            for _, handle in ops:
                handle.works = list(works)

    # ---- sending --------------------------------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.detach().to(self.device).contiguous()
        self._pending.append((self._queue(dist.isend, tensor, stage), tensor))

    def _send_leaf(self, leaf: torch.Tensor, stage: int, fp8: torch.dtype) -> None:
        """One activation (`fp8` E4M3) or gradient (E5M2) tensor; as fp8 with its scale under fp8_communication."""
        if self.fp8_communication and leaf.dtype in _COMPRESSIBLE:
            leaf = pack_fp8(leaf.to(self.device), fp8)
        self._isend(leaf, stage)

    def _post_leaf(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> tuple[torch.Tensor, _Handle]:
        """Post the receive of one tensor sent by `_send_leaf` (its wire buffer under fp8_communication)."""
        if self.fp8_communication and dtype in _COMPRESSIBLE:
            shape, dtype = _wire_spec(shape, dtype)
        return self._post_recv(shape, dtype, stage)

    def _leaf(self, buffer: torch.Tensor, like: Any, fp8: torch.dtype) -> torch.Tensor:
        """The tensor a `_post_leaf` buffer carried; `like` has its shape and dtype (a tensor or a leaf's meta)."""
        if self.fp8_communication and like.dtype in _COMPRESSIBLE:
            return unpack_fp8(buffer, tuple(like.shape), like.dtype, fp8)
        return buffer

    def _send_bytes(self, status: int, data: bytes, stage: int) -> None:
        self._isend(torch.tensor([status, len(data)], dtype=torch.int64), stage)
        if data:
            self._isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), stage)

    def send_activation(self, stage: int, message: Message, value: Any) -> None:
        """Header, then the tensors; the metadata too (after a filler the receiver posted for) when it changed."""
        virtual = message[1]
        leaves, meta = flatten(value, f"the output of virtual stage {virtual - 1}")
        data = meta.to_bytes()
        cached = self._sent_meta.get(virtual)
        if cached is not None and cached == meta:
            self._isend(torch.tensor([_CACHED, 0, zlib.crc32(data)], dtype=torch.int64), stage)
        elif cached is not None and self._send_stable.get(virtual, 0) >= SETTLE_STEPS:
            raise PipelineConfigError(
                f"pipeline stage {self._stage}: the output of virtual stage {virtual - 1} for micro-batch "
                f"{message[2]} is {_shapes(meta)}, but it was {_shapes(cached)} for the last {SETTLE_STEPS}+ steps "
                "and the next stage now receives that shape without reading a header (issue 37). A stage whose "
                "output shape depends on the data (not on the batch's shapes, which re-probe) needs "
                "enable_metadata_cache=False"
            )
        else:
            self._send_changed.add(virtual)
            self._isend(torch.tensor([_NEW, len(data), zlib.crc32(data)], dtype=torch.int64), stage)
            for filler in cached.leaves if cached is not None else ():
                shape, dtype = tuple(filler.shape), filler.dtype
                if self.fp8_communication and dtype in _COMPRESSIBLE:
                    shape, dtype = _wire_spec(shape, dtype)
                self._isend(torch.zeros(shape, dtype=dtype), stage)
            self._isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), stage)
            if self.enable_metadata_cache:
                self._sent_meta[virtual] = meta
        for leaf in leaves:
            self._send_leaf(leaf, stage, E4M3)
        self.remember_sent(("grad", virtual - 1, message[2]), leaves)

    def remember_sent(self, message: Message, leaves: list[torch.Tensor]) -> None:
        """Gradients come back for the floating-point leaves sent forward (zeros where the receiver did not use one)."""
        self._sent_like[message] = [leaf for leaf in leaves if leaf.is_floating_point()]

    def send_grads(self, stage: int, grads: list[torch.Tensor]) -> None:
        for grad in grads:
            self._send_leaf(grad, stage, E5M2)

    def grads_like(self, message: Message) -> list[torch.Tensor]:
        """The tensors whose gradients `message` ("grad", v, mb) carries: what this rank sent forward for (v+1, mb)."""
        return self._sent_like[message]

    def prune(self) -> None:
        """Drop finished sends (their buffers) so memory does not grow over a step."""
        self._pending = [(h, t) for h, t in self._pending if not h.works or not h.done()]

    def wait_all(self) -> None:
        """Wait for every send issued so far."""
        self.flush()
        for handle, _ in self._pending:
            for work in handle.works:
                self._wait(work, f"pipeline send from stage {self._stage} (rank {self._ranks[self._stage]})")
        self._pending = []

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for one transfer; a timeout or a failed peer raises an error saying `what` it was, on which group
        (`cx_mesh.named_collective`). Waited for once, not in slices: a gloo transfer whose wait runs out is closed."""
        with named_collective(what, self._group):
            work.wait()

    def _from(self, stage: int) -> str:
        return f"pipeline receive from stage {stage} (rank {self._ranks[stage]})"

    def end_step(self) -> None:
        self.wait_all()
        if any(self._posted.values()) or any(self._expected.values()):
            raise RuntimeError(f"stage {self._stage} ended a step with messages still expected: {self._expected}")
        self._sent_like = {}
        self._inbox = {}
        for stable, changed, edges in (
            (self._send_stable, self._send_changed, self._sent_meta),
            (self._recv_stable, self._recv_changed, self.act_meta),
        ):
            for virtual in edges:
                stable[virtual] = 0 if virtual in changed else stable.get(virtual, 0) + 1
            changed.clear()

    def unsettle(self) -> None:
        """Every edge starts settling again (the probe renegotiates all metadata)."""
        self._send_stable, self._recv_stable = {}, {}
        self._send_changed, self._recv_changed = set(), set()
        self._expected_header = {}

    def _settled(self, virtual: int) -> bool:
        return self._cached(virtual) is not None and self._recv_stable.get(virtual, 0) >= SETTLE_STEPS

    # ---- receiving ------------------------------------------------------------------------------------------------
    def _post_recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> tuple[torch.Tensor, _Handle]:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer, self._queue(dist.irecv, buffer, stage)

    def _await(self, handles: list[_Handle], stage: int) -> None:
        self.flush()
        for handle in handles:
            for work in handle.works:
                self._wait(work, self._from(stage))

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> torch.Tensor:
        buffer, handle = self._post_recv(shape, dtype, stage)
        self._await([handle], stage)
        return buffer

    def _recv_bytes(self, stage: int) -> tuple[int, bytes]:
        header = self._recv((2,), torch.int64, stage)
        status, size = int(header[0]), int(header[1])
        data = bytes(self._recv((size,), torch.uint8, stage).tolist()) if size else b""
        return status, data

    def _recv_leaves(self, meta: TreeMeta, stage: int, wire: bool = True) -> list[torch.Tensor]:
        """`meta`'s tensors from `stage`; `wire=False` (the probe): full precision whatever fp8_communication says."""
        post = self._post_leaf if wire else self._post_recv
        posted = [post(leaf.shape, leaf.dtype, stage) for leaf in meta.leaves]
        self._await([handle for _, handle in posted], stage)
        if not wire:
            return [buffer for buffer, _ in posted]
        return [self._leaf(buffer, leaf, E4M3) for (buffer, _), leaf in zip(posted, meta.leaves, strict=True)]

    def _cached(self, virtual: int) -> TreeMeta | None:
        return self.act_meta.get(virtual) if self.enable_metadata_cache else None

    def _post_activation(self, stage: int, message: Message) -> _Posted:
        """Post the header of an activation and, with a cache for its edge, tensors of the cached shapes."""
        header, handle = self._post_recv((3,), torch.int64, stage)
        cached = self._cached(message[1])
        posted = [self._post_leaf(leaf.shape, leaf.dtype, stage) for leaf in cached.leaves] if cached else []
        settled = self._settled(message[1])
        return _Posted(message, [handle] + [h for _, h in posted], [b for b, _ in posted], header, settled)

    def _header_checked_on_device(self, virtual: int, header: torch.Tensor) -> bool:
        """A settled edge's header compared with the expected one on the device, without a host read; False when
        that check ran at once and failed (CPU), so the caller reads and names the mismatch."""
        expected = self._expected_header.get(virtual)
        if expected is None:
            cached = self.act_meta[virtual]
            expected = torch.tensor([_CACHED, 0, _crc(cached)], dtype=torch.int64, device=header.device)
            self._expected_header[virtual] = expected
        try:
            torch._assert_async(
                torch.eq(header, expected).all(),
                f"pipeline stage {self._stage}: an activation header for virtual stage {virtual} does not match the "
                "settled metadata (a neighbour's output shape changed, or the stages ran different steps)",
            )
        except RuntimeError:
            return False
        return True

    def _open_activation(self, stage: int, posted: _Posted) -> Any:
        """The value of a received activation: its header read and checked, the metadata and tensors received when
        the sender's output differed from the cache."""
        _, virtual, mb = posted.message
        assert posted.header is not None
        if posted.settled and self._header_checked_on_device(virtual, posted.header):
            settled = self.act_meta[virtual]
            leaves = [self._leaf(b, leaf, E4M3) for b, leaf in zip(posted.buffers, settled.leaves, strict=True)]
            for buffer, leaf in zip(leaves, settled.leaves, strict=True):
                buffer.requires_grad_(leaf.requires_grad)
            return unflatten(settled, leaves)
        status, size, crc = (int(x) for x in posted.header.tolist())
        cached = self._cached(virtual)
        if status == _CACHED and cached is not None:
            if crc != _crc(cached):
                raise PipelineConfigError(
                    f"pipeline stage {self._stage} received micro-batch {mb}'s input of virtual stage {virtual} from "
                    f"stage {stage}, whose metadata does not match the one cached here ({_shapes(cached)}): the two "
                    "stages' metadata caches disagree (did every stage run the same steps?)"
                )
            meta = cached
            leaves = [self._leaf(b, leaf, E4M3) for b, leaf in zip(posted.buffers, cached.leaves, strict=True)]
        elif status == _NEW:
            data = bytes(self._recv((size,), torch.uint8, stage).tolist())
            if zlib.crc32(data) != crc:
                raise PipelineConfigError(f"pipeline stage {self._stage}: corrupt metadata from stage {stage}")
            meta = TreeMeta.from_bytes(data)
            leaves = self._recv_leaves(meta, stage)
            if self.enable_metadata_cache:
                self.act_meta[virtual] = meta
                self._recv_changed.add(virtual)
                self._expected_header.pop(virtual, None)
        else:
            raise PipelineConfigError(
                f"pipeline stage {self._stage} got an activation header with status {status} from stage {stage} "
                f"for virtual stage {virtual}, micro-batch {mb}: the stages disagree on the metadata cache"
            )
        for buffer, leaf in zip(leaves, meta.leaves, strict=True):
            buffer.requires_grad_(leaf.requires_grad)
        return unflatten(meta, leaves)

    def _post(self, stage: int) -> None:
        """Post the receives of the next messages from `stage` ahead of need (up to `RECV_WINDOW` per neighbour, in
        its sending order), so their transfer overlaps this rank's compute. Nothing is posted behind an activation
        whose header is unread: what follows it on the channel depends on that header (unless its edge is settled:
        then what follows is known)."""
        queue = self._expected.get(stage)
        posted = self._posted.setdefault(stage, [])
        while self.overlap and queue and len(posted) < RECV_WINDOW:
            if posted and posted[-1].header is not None and not posted[-1].settled:
                return
            message = queue[0]
            kind, virtual, _ = message
            if kind == "act":
                if self._cached(virtual) is None:
                    return  # its metadata comes first, in the message itself
                queue.pop(0)
                posted.append(self._post_activation(stage, message))
            elif message in self._sent_like:
                queue.pop(0)
                received = [self._post_leaf(tuple(t.shape), t.dtype, stage) for t in self._sent_like[message]]
                posted.append(_Posted(message, [h for _, h in received], [b for b, _ in received], None))
            else:
                return  # a gradient for an activation not sent yet: its shapes are not known

    def prefetch(self) -> None:
        """Take what has arrived, post the next receives from every neighbour (see `_post`), and issue the batch."""
        for stage in self._expected:
            self._post(stage)
        self.flush()
        for stage in self._expected:
            posted = self._posted.get(stage)
            while posted and posted[0].header is not None and not posted[0].settled and posted[0].handles[0].done():
                self._take_next(stage)  # an activation's header is in: read it, so the channel can move on
        self.flush()

    def _take_next(self, stage: int) -> None:
        posted = self._posted.get(stage)
        if posted:
            entry = posted.pop(0)
            self._await(entry.handles, stage)
            if entry.header is None:
                like = self.grads_like(entry.message)
                self._inbox[entry.message] = [self._leaf(b, t, E5M2) for b, t in zip(entry.buffers, like, strict=True)]
            else:
                self._inbox[entry.message] = self._open_activation(stage, entry)
            self._post(stage)  # refill the window before the caller computes with this message
            self.flush()
            return
        queue = self._expected.get(stage)
        if not queue:
            raise RuntimeError(f"stage {self._stage} expected no more messages from stage {stage} this step")
        message = queue.pop(0)
        if message[0] == "act":
            entry = self._post_activation(stage, message)
            self._await(entry.handles, stage)
            self._inbox[message] = self._open_activation(stage, entry)
        else:
            like = self.grads_like(message)
            grads = [self._post_leaf(tuple(t.shape), t.dtype, stage) for t in like]
            self._await([handle for _, handle in grads], stage)
            self._inbox[message] = [self._leaf(b, t, E5M2) for (b, _), t in zip(grads, like, strict=True)]

    def ready(self, stage: int, message: Message) -> bool:
        """Whether `message` from `stage` can be taken without waiting (already here, or its posted receive done)."""
        self.flush()
        while message not in self._inbox:
            posted = self._posted.get(stage)
            if not posted or not all(handle.done() for handle in posted[0].handles):
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

    # ---- probe: status + metadata + tensors; on success both ends cache the edge's metadata -----------------------
    def probe_send(self, stage: int, virtual: int, value: Any | None, error: str | None) -> None:
        """Send virtual stage `virtual`'s probe input (or the error that stands in for it) to `stage`."""
        if error is not None:
            self._send_bytes(_STATUS_ERROR, error.encode(), stage)
        else:
            leaves, meta = flatten(value)
            self._send_bytes(_STATUS_OK, meta.to_bytes(), stage)
            for leaf in leaves:
                self._isend(leaf, stage)
            if self.enable_metadata_cache:
                self._sent_meta[virtual] = meta
        self.flush()

    def probe_receive(self, stage: int, virtual: int) -> tuple[Any, TreeMeta | None, str | None]:
        """Virtual stage `virtual`'s probe input from `stage`: (value, metadata, None) or (None, None, error)."""
        status, data = self._recv_bytes(stage)
        if status != _STATUS_OK:
            return None, None, data.decode()
        meta = TreeMeta.from_bytes(data)
        leaves = self._recv_leaves(meta, stage, wire=False)
        for buffer, leaf in zip(leaves, meta.leaves, strict=True):
            buffer.requires_grad_(leaf.requires_grad)
        if self.enable_metadata_cache:
            self.act_meta[virtual] = meta
        return unflatten(meta, leaves), meta, None
