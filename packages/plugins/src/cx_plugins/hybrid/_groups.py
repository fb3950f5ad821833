"""ColossalAI's size and group attributes of the hybrid plugins (its examples read e.g. `plugin.dp_group`), read
from the plugin's `ParallelLayout`: the layout owns every group, nothing here computes a rank."""

from __future__ import annotations

from cx_mesh import ProcessGroup
from cx_plugins._layout import Axis, ParallelLayout
from cx_plugins.hybrid._options import HybridParallelOptions

__all__ = ["LayoutAttributes"]


class LayoutAttributes:
    """Sizes and groups of a hybrid plugin's layout; `MoeHybridParallelPlugin` overrides the data-parallel ones."""

    layout: ParallelLayout
    options: HybridParallelOptions

    @property
    def tp_size(self) -> int:
        return self.layout.size(Axis.TP)

    @property
    def pp_size(self) -> int:
        return self.layout.size(Axis.PP)

    @property
    def dp_size(self) -> int:
        return self.layout.size(Axis.DP)

    @property
    def sp_size(self) -> int:
        return self.layout.size(Axis.SP)

    @property
    def enable_pipeline_parallelism(self) -> bool:
        return self.pp_size > 1

    # ColossalAI's group attributes (its examples read e.g. plugin.dp_group); the layout owns them
    @property
    def dp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.DP)

    @property
    def tp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.TP)

    @property
    def pp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.PP)

    @property
    def sp_group(self) -> ProcessGroup:
        """The group the sequence is split over: the tp group for split_gather / ring, else the sp axis."""
        return self.layout.group(Axis.SP) if self.options.sp_mode.on_sp_axis else self.layout.group(Axis.TP)

    def _gradient_group(self) -> ProcessGroup | None:
        """The group gradients are averaged over: dp, or dp x sp under Ulysses (as ColossalAI; equal results)."""
        if self.options.sp_mode.on_sp_axis:
            return self.layout.group_or_none(Axis.DP, Axis.SP)
        return self.layout.group_or_none(Axis.DP)
