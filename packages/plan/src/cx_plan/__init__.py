"""cx-plan: which configuration of which plugin fits a model on N devices, and how fast it runs, said before launch.

The planner judges `Candidate` configurations for a `ModelShape` (read from a preset, a model folder or a
config.json): per-rank memory from the plugins' sharding rules and a FakeTensor trace of the real model, step time
from FLOPs, collective volumes and the pipeline schedule.
"""

from cx_plugins.plan._activations import ActivationTrace, PlanTraceError, trace_stage
from cx_plugins.plan._candidate import Candidate
from cx_plugins.plan._cli import main
from cx_plugins.plan._devices import Device, Link, Network, lookup_device, lookup_link, parse_memory
from cx_plugins.plan._enumerate import NoLayoutError, SearchSpace, enumerate_candidates
from cx_plugins.plan._fits import Verdict, fits
from cx_plugins.plan._memory import MemoryPrediction, predict_memory
from cx_plugins.plan._memory_model import memory_model
from cx_plugins.plan._model_spec import ModelShape, ModelShapeError, ParameterCounts, load_model_shape
from cx_plugins.plan._planner import judge, plan
from cx_plugins.plan._report import PlanReport, PlanRow
from cx_plugins.plan._step_time import StepTime, predict_step_time

__all__ = [
    "Candidate",
    "ModelShape",
    "ModelShapeError",
    "ParameterCounts",
    "load_model_shape",
    # memory: the FakeTensor trace, the per-rank prediction, fits / does not fit
    "ActivationTrace",
    "PlanTraceError",
    "trace_stage",
    "MemoryPrediction",
    "predict_memory",
    "Verdict",
    "fits",
    "memory_model",
    # step time, devices, enumeration and the ranked plan (cx-plan)
    "Device",
    "Link",
    "Network",
    "lookup_device",
    "lookup_link",
    "parse_memory",
    "NoLayoutError",
    "SearchSpace",
    "enumerate_candidates",
    "StepTime",
    "predict_step_time",
    "PlanReport",
    "PlanRow",
    "judge",
    "plan",
    "main",
]
