"""cx-plan: which configuration of which plugin fits a model on N devices, and how fast it runs, said before launch.

The planner judges `Candidate` configurations for a `ModelShape` (read from a preset, a model folder or a
config.json): per-rank memory from the plugins' sharding rules and a FakeTensor trace of the real model, step time
from FLOPs, collective volumes and the pipeline schedule.
"""

from cx_plugins.plan._candidate import Candidate
from cx_plugins.plan._model_spec import ModelShape, ModelShapeError, ParameterCounts, load_model_shape

__all__ = ["Candidate", "ModelShape", "ModelShapeError", "ParameterCounts", "load_model_shape"]
