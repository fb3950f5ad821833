"""Learning-rate schedulers with ColossalAI's names and arguments (`colossalai.nn.lr_scheduler`), on torch's own.

Replace `from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR` with
`from cx_plugins.lr_scheduler import CosineAnnealingWarmupLR`; the curves and `state_dict`s are torch's.
"""

from cx_plugins.lr_scheduler._schedulers import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    ExponentialLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LambdaLR,
    LinearWarmupLR,
    MultiplicativeLR,
    MultiStepLR,
    MultiStepWarmupLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
    StepLR,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]
