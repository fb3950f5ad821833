"""cx-chunk: Gemini's chunk layer. Parameters are packed into large 1-D chunks, the unit of sharding,
communication and placement.

- `Chunk`, `TensorState` (+ `LEGAL_TRANSITIONS`), `Residence`, `TensorSlot`, `ShardView`, `MemoryUsage`.
- `ChunkManager`: chunk groups, access/release/move/reduce, master and gradient chunks, memory accounting.
- `ChunkConfig`, `search_chunk_configuration`.
- `PlacementPolicy`, `StaticPlacementPolicy`, `AutoPlacementPolicy`, `ChunkScheduler` (periods, prefetch),
  `MemStats`, `MemoryTracer`, `StepTrace`.
"""

from cx_chunk._auto_policy import AutoPlacementPolicy, BudgetRecord, Eviction
from cx_chunk._chunk import Chunk
from cx_chunk._config import ChunkConfig
from cx_chunk._errors import BudgetError, ChunkError, ChunkFullError, IllegalTransitionError
from cx_chunk._layout import MemoryUsage, Residence, ShardView, TensorSlot
from cx_chunk._manager import ChunkManager
from cx_chunk._memstats import MemoryTracer, MemStats, PeriodRecord
from cx_chunk._policy import PlacementPolicy, gather_cost
from cx_chunk._scheduler import ChunkScheduler
from cx_chunk._search import ChunkSearchResult, next_fit_waste, search_chunk_configuration
from cx_chunk._states import LEGAL_TRANSITIONS, TensorState, check_transition
from cx_chunk._static_policy import StaticPlacementPolicy, select_by_fraction
from cx_chunk._trace import StepTrace

__all__ = [
    # chunks
    "Chunk",
    "MemoryUsage",
    "Residence",
    "ShardView",
    "TensorSlot",
    # states
    "LEGAL_TRANSITIONS",
    "TensorState",
    "check_transition",
    # errors
    "BudgetError",
    "ChunkError",
    "ChunkFullError",
    "IllegalTransitionError",
    # manager and configuration
    "ChunkConfig",
    "ChunkManager",
    "ChunkSearchResult",
    "next_fit_waste",
    "search_chunk_configuration",
    # placement
    "AutoPlacementPolicy",
    "BudgetRecord",
    "ChunkScheduler",
    "Eviction",
    "PlacementPolicy",
    "StaticPlacementPolicy",
    "StepTrace",
    "gather_cost",
    "select_by_fraction",
    # memory statistics
    "MemStats",
    "MemoryTracer",
    "PeriodRecord",
]
