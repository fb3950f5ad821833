"""`PipelineStageManager`: where this rank sits in the pipeline, and which layers each stage (and chunk) holds.

The surface follows ColossalAI's class of the same name. A pipeline of `num_stages` ranks runs `num_model_chunks`
chunks per rank, so there are `num_stages * num_model_chunks` *virtual stages* that activations visit in order:

- plain (1F1B): one chunk; virtual stage = stage.
- interleaved: chunk `c` of stage `s` is virtual stage `c * num_stages + s` (activations loop round the ring).
- zero-bubble V (`use_zbv`): two chunks; chunk 0 is virtual stage `s`, chunk 1 is `2 * num_stages - 1 - s`, so the
  first and the last virtual stages both live on stage 0 (the "V").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from cx_mesh import Axis, ProcessGroup, ProcessGroupMesh
from cx_pipeline._balance import LayerCosts, balanced_layers
from cx_pipeline._errors import PipelineConfigError

__all__ = ["PipelineStageManager"]


class PipelineStageManager:
    """Stage index, neighbours, the pipeline group, and the layer distribution of a pipeline axis of a mesh."""

    def __init__(
        self,
        pg_mesh: ProcessGroupMesh,
        pipeline_axis: Axis,
        enable_interleave: bool = False,
        use_zbv: bool = False,
        num_model_chunks: int = 1,
        num_layers_per_stage: Sequence[int] | None = None,
        balance_layers: bool = False,
    ) -> None:
        if not isinstance(num_model_chunks, int) or num_model_chunks < 1:
            raise PipelineConfigError(f"num_model_chunks must be a positive integer, got {num_model_chunks!r}")
        if use_zbv and num_model_chunks != 2:
            raise PipelineConfigError(
                f"use_zbv needs num_model_chunks=2 (the two arms of the V), got {num_model_chunks}"
            )
        if enable_interleave and not use_zbv and num_model_chunks < 2:
            raise PipelineConfigError("enable_interleave needs num_model_chunks >= 2 (one chunk is plain 1F1B)")
        if not enable_interleave and not use_zbv and num_model_chunks != 1:
            raise PipelineConfigError(
                f"num_model_chunks={num_model_chunks} needs enable_interleave=True (or use_zbv=True); "
                "a plain 1F1B pipeline holds one chunk per stage"
            )
        self.pg_mesh = pg_mesh
        self.pipeline_axis = pg_mesh.axis_index(pipeline_axis)
        self.is_interleave = enable_interleave or use_zbv
        self.use_zbv = use_zbv
        self.num_model_chunks = num_model_chunks
        self.model_chunk_id: int | None = None
        self._num_stages = pg_mesh.size(self.pipeline_axis)
        self._stage = pg_mesh.coordinate(self.pipeline_axis)
        if balance_layers and num_layers_per_stage is not None:
            raise PipelineConfigError(
                "balance_layers splits the layers by cost, num_layers_per_stage gives the split: pass one of them"
            )
        self.balance_layers = balance_layers
        if num_layers_per_stage is not None:
            layers = list(num_layers_per_stage)
            expected = self._num_stages * num_model_chunks
            if len(layers) != expected or any(not isinstance(n, int) or n < 1 for n in layers):
                raise PipelineConfigError(
                    f"num_layers_per_stage must list {expected} positive layer counts (num_stages={self._num_stages} "
                    f"x num_model_chunks={num_model_chunks}), got {layers}"
                )
            self.num_layers_per_stage: list[int] | None = layers
        else:
            self.num_layers_per_stage = None
        coordinate = list(pg_mesh.coordinate())
        self._stage_ranks: list[int] = []
        for stage in range(self._num_stages):
            coordinate[self.pipeline_axis] = stage
            self._stage_ranks.append(ProcessGroupMesh.ravel(coordinate, pg_mesh.shape))
        self.prev_rank = self._stage_ranks[(self._stage - 1) % self._num_stages]
        self.next_rank = self._stage_ranks[(self._stage + 1) % self._num_stages]
        self.stage_indices: list[tuple[int, int]] | tuple[int, int] | None = None
        # Collective: every rank builds its stage manager, so every rank creates the pipeline groups here.
        self.pp_group: ProcessGroup = pg_mesh.get_group_along_axis(self.pipeline_axis)

    # ---- where this rank is ------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def stage(self) -> int:
        return self._stage

    @property
    def num_virtual_stages(self) -> int:
        return self._num_stages * self.num_model_chunks

    def get_rank(self) -> int:
        return self.pg_mesh.rank

    def get_prev_rank(self) -> int:
        return self.prev_rank

    def get_next_rank(self) -> int:
        return self.next_rank

    def rank_of_stage(self, stage: int) -> int:
        """The global rank holding pipeline stage `stage` in this rank's pipeline (same coordinates elsewhere)."""
        return self._stage_ranks[stage]

    @property
    def stage_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, stage 0 first."""
        return list(self._stage_ranks)

    def virtual_stage(self, chunk: int, stage: int | None = None) -> int:
        """The virtual stage (position along the activations' path) of `chunk` on `stage` (default: this one)."""
        stage = self._stage if stage is None else stage
        if not 0 <= chunk < self.num_model_chunks:
            raise ValueError(f"chunk {chunk} is outside [0, {self.num_model_chunks})")
        if self.use_zbv:
            return stage if chunk == 0 else 2 * self._num_stages - 1 - stage
        return chunk * self._num_stages + stage

    def locate_virtual_stage(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) holding `virtual_stage`."""
        p = self._num_stages
        if not 0 <= virtual_stage < self.num_virtual_stages:
            raise ValueError(f"virtual stage {virtual_stage} is outside [0, {self.num_virtual_stages})")
        if self.use_zbv:
            return (virtual_stage, 0) if virtual_stage < p else (2 * p - 1 - virtual_stage, 1)
        return virtual_stage % p, virtual_stage // p

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank runs the first virtual stage (with the current chunk, unless `ignore_chunk`)."""
        if not self.is_interleave or ignore_chunk:
            return self._stage == 0
        self._require_chunk_id()
        return self.virtual_stage(self._chunk_id()) == 0

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank runs the last virtual stage (with the current chunk, unless `ignore_chunk`)."""
        if not self.is_interleave or ignore_chunk:
            return self._stage == self._num_stages - 1
        self._require_chunk_id()
        return self.virtual_stage(self._chunk_id()) == self.num_virtual_stages - 1

    def _require_chunk_id(self) -> None:
        if self.model_chunk_id is None:
            raise RuntimeError(
                "is_first_stage / is_last_stage of an interleaved pipeline depend on the model chunk: call them "
                "inside stage_manager.switch_model_chunk_id(chunk), or pass ignore_chunk=True"
            )

    def _chunk_id(self) -> int:
        assert self.model_chunk_id is not None
        return self.model_chunk_id

    @contextlib.contextmanager
    def switch_model_chunk_id(self, model_chunk_id: int) -> Iterator[None]:
        """Within the block, `is_first_stage` / `is_last_stage` refer to chunk `model_chunk_id`."""
        if not 0 <= model_chunk_id < self.num_model_chunks:
            raise ValueError(f"model_chunk_id {model_chunk_id} is outside [0, {self.num_model_chunks})")
        previous = self.model_chunk_id
        self.model_chunk_id = model_chunk_id
        try:
            yield
        finally:
            self.model_chunk_id = previous

    # ---- layer distribution -------------------------------------------------------------------------------------
    def distribute_layers(
        self,
        num_layers: int,
        num_stages: int | None = None,
        num_model_chunks: int | None = None,
        costs: LayerCosts | None = None,
    ) -> list[int]:
        """Layers per virtual stage (stage-major per chunk: chunk 0's stages first, then chunk 1's, ...).

        `num_layers_per_stage` when given (it must sum to `num_layers`); with `costs` (`balance_layers`) the
        contiguous split whose costliest virtual stage is cheapest (`cx_pipeline._balance`); otherwise an even split,
        the remainder going to the middle stages, because the first holds the embeddings and the last the head.
        """
        num_stages = self._num_stages if num_stages is None else num_stages
        num_model_chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        slots = num_stages * num_model_chunks
        if self.num_layers_per_stage is not None:
            if sum(self.num_layers_per_stage) != num_layers:
                raise PipelineConfigError(
                    f"num_layers_per_stage {self.num_layers_per_stage} sums to {sum(self.num_layers_per_stage)}, "
                    f"but the model has {num_layers} layers"
                )
            return list(self.num_layers_per_stage)
        if num_layers < slots:
            raise PipelineConfigError(
                f"the model has {num_layers} layers, fewer than the {slots} pipeline slots (num_stages={num_stages} x "
                f"num_model_chunks={num_model_chunks}): every stage needs at least one layer"
            )
        if self.balance_layers and costs is None:
            raise PipelineConfigError(
                "balance_layers: distribute_layers needs the layer costs (split_model passes layer_costs(model)); "
                "without them the split would silently be the even one"
            )
        if costs is not None:
            if len(costs.layers) != num_layers:
                raise PipelineConfigError(f"{len(costs.layers)} layer costs for a model of {num_layers} layers")
            return balanced_layers(costs, slots)
        quotient, remainder = divmod(num_layers, slots)
        layers = [quotient] * slots
        start = slots // 2 - remainder // 2
        for index in range(start, start + remainder):
            layers[index] += 1
        return layers

    def get_stage_index(
        self,
        layers_per_stage: Sequence[int],
        stage: int | None = None,
        num_model_chunks: int | None = None,
        num_stages: int | None = None,
    ) -> tuple[int, int] | list[tuple[int, int]]:
        """[start, end) layer range of `stage` (default this one): a pair for one chunk, a list of pairs per chunk.

        `layers_per_stage` is indexed by virtual stage; with `use_zbv` chunk 1 of stage `s` is virtual stage
        `2 * num_stages - 1 - s`, which is the V shape.
        """
        stage = self._stage if stage is None else stage
        num_stages = self._num_stages if num_stages is None else num_stages
        num_model_chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        if len(layers_per_stage) != num_stages * num_model_chunks:
            raise PipelineConfigError(
                f"layers_per_stage lists {len(layers_per_stage)} counts for {num_stages * num_model_chunks} slots"
            )
        starts = [0]
        for count in layers_per_stage:
            starts.append(starts[-1] + count)
        ranges = []
        for chunk in range(num_model_chunks):
            if self.use_zbv:
                virtual = stage if chunk == 0 else 2 * num_stages - 1 - stage
            else:
                virtual = chunk * num_stages + stage
            ranges.append((starts[virtual], starts[virtual + 1]))
        return ranges[0] if num_model_chunks == 1 else ranges

    def init_process_group_by_stages(self, stages: Sequence[int]) -> ProcessGroup | None:
        """The group of the given pipeline stages (collective on every rank of the mesh; None where not a member)."""
        return self.pg_mesh.create_group_along_axis(self.pipeline_axis, indices_at_axis=sorted(set(stages)))

    def __repr__(self) -> str:
        return (
            f"PipelineStageManager(stage={self._stage}/{self._num_stages}, chunks={self.num_model_chunks}, "
            f"interleave={self.is_interleave}, zbv={self.use_zbv})"
        )
