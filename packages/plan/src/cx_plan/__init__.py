"""cx-plan: which configuration of which plugin fits a model on N devices, and how fast it runs, said before launch.

The planner judges `Candidate` configurations for a `ModelShape` (read from a preset, a model folder or a
config.json): per-rank memory from the plugins' sharding rules and a FakeTensor trace of the real model, step time
from FLOPs, collective volumes and the pipeline schedule. `make_plugin` turns a candidate into the plugin that runs
it (cx-train builds its own plugin with it).

Folders by concern: `trace/` (the model's shape and its FakeTensor trace), `memory/` (bytes per rank, the fit),
`step_time/` (compute, collectives, host time), `measure/` (`cx-plan --measure`); the enumeration, the ranked report
and the command line at the top.
"""

from cx_plan._candidate import Candidate, Optimizer
from cx_plan._cli import build_parser, main
from cx_plan._devices import (
    Device,
    Link,
    Network,
    detect_device,
    lookup_device,
    lookup_link,
    memory_per_rank,
    parse_memory,
)
from cx_plan._enumerate import NoLayoutError, SearchSpace, enumerate_candidates
from cx_plan._planner import judge, plan
from cx_plan._plugin import make_plugin
from cx_plan._report import PlanReport, PlanRow, train_command
from cx_plan.measure._measure import Measured, measure_candidate
from cx_plan.memory._fits import Verdict, fits, format_bytes
from cx_plan.memory._memory import MemoryPrediction, predict_memory
from cx_plan.memory._memory_model import memory_model
from cx_plan.step_time._step_time import ACHIEVABLE_FRACTION, StepTime, predict_step_time
from cx_plan.trace._activations import ActivationTrace, PlanTraceError, trace_stage
from cx_plan.trace._model_spec import (
    TEXT_VOCAB_SIZE,
    ModelShape,
    ModelShapeError,
    ParameterCounts,
    build_model,
    load_model_shape,
)

__all__ = [
    "Candidate",
    "Optimizer",
    "make_plugin",
    "TEXT_VOCAB_SIZE",
    "ModelShape",
    "ModelShapeError",
    "ParameterCounts",
    "load_model_shape",
    "build_model",
    # memory: the FakeTensor trace, the per-rank prediction, fits / does not fit
    "ActivationTrace",
    "PlanTraceError",
    "trace_stage",
    "MemoryPrediction",
    "predict_memory",
    "Verdict",
    "fits",
    "format_bytes",
    "memory_model",
    # step time, devices, enumeration and the ranked plan (cx-plan)
    "Device",
    "Link",
    "Network",
    "detect_device",
    "memory_per_rank",
    "lookup_device",
    "lookup_link",
    "parse_memory",
    "NoLayoutError",
    "SearchSpace",
    "enumerate_candidates",
    "ACHIEVABLE_FRACTION",
    "StepTime",
    "predict_step_time",
    "PlanReport",
    "PlanRow",
    "train_command",
    "Measured",
    "measure_candidate",
    "judge",
    "plan",
    "main",
    "build_parser",  # cx-plan's flags and defaults (cx-train's tests compare them with its own)
]
