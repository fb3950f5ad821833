"""Tolerances derived from floating-point arithmetic, for comparing a parallel run with a single-process one.

Two runs that add the same terms in another order (tensor-parallel partial sums, an all-reduce tree, another CPU's
vector kernels) differ only by rounding. Deterministically a sum of n terms is off by at most gamma_n * sum|terms|,
gamma_n = n*u / (1 - n*u), u the unit roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1);
rounding errors are independent and centred, so with probability at least 1 - 2*exp(-lambda**2 / 2) the error is
within lambda * sqrt(n) * u * sum|terms| (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019). The probabilistic bound
at lambda = 6 (failure probability 3e-8 per sum) is the one the tests use: the deterministic one grows with n and is
vacuous for the sums of a training step.

Adam changes the picture: its step lr * m / (sqrt(v) + eps) normalises the gradient, so an element whose gradient is
near zero takes a step of about lr whose sign its rounding decides (the default eps = 1e-8 is far below fp32 noise).
The step's sensitivity to the gradient is at most lr / eps (the slope of g / (|g| + eps) at g = 0), so a test that
compares parameters after Adam steps gives its optimizer an eps well above the gradient's rounding error and bounds
the parameters' difference by `adam_parameter_tolerance`.
"""

from __future__ import annotations

import math

import torch

#: The multiple of the probabilistic rounding bound the tests allow (failure probability 2 * exp(-18) per sum).
CONFIDENCE = 6.0

#: An Adam/AdamW eps for tests that compare parameters across layouts: three orders above the fp32 rounding error of
#: a tiny model's gradients (about 1e-7, see `sum_tolerance`), so the step is a smooth function of the gradient, and
#: at the size of the smaller gradients, so the larger ones still take Adam's normalised step. Measured on the tiny
#: Llama of the hybrid resume tests under the AVX2 kernels: the parameters after 5 AdamW steps at lr 1e-2 differ by
#: 1.5e-4 across layouts at eps 1e-8, 6e-6 at 1e-4 and 6e-8 at 1e-3.
TEST_ADAM_EPS = 1e-3


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the gap between 1 and the next representable number: 2**-24 for fp32, 2**-8 for bf16."""
    return torch.finfo(dtype).eps / 2


def sum_tolerance(n_terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """The absolute difference two orderings of a sum of `n_terms` terms with sum|terms| <= `magnitude` stay within
    (the probabilistic bound at `CONFIDENCE`)."""
    if n_terms < 1 or magnitude < 0:
        raise ValueError(f"sum_tolerance needs n_terms >= 1 and magnitude >= 0, got {n_terms}, {magnitude}")
    return CONFIDENCE * math.sqrt(n_terms) * unit_roundoff(dtype) * magnitude


def adam_step_tolerance(lr: float, eps: float, grad_tolerance: float) -> float:
    """How far one Adam/AdamW step of two runs can differ when their gradients differ by at most `grad_tolerance`
    per element: lr * grad_tolerance / eps (the update's Lipschitz constant), never more than 2 * lr (opposite
    signs of a normalised step)."""
    if lr <= 0 or eps <= 0 or grad_tolerance < 0:
        raise ValueError(f"adam_step_tolerance needs lr > 0, eps > 0, grad_tolerance >= 0; got {lr}, {eps}")
    return min(lr * grad_tolerance / eps, 2 * lr)


def adam_parameter_tolerance(lr: float, eps: float, steps: int, grad_tolerance: float) -> float:
    """The parameters' absolute difference after `steps` Adam steps from equal weights: the steps' differences add
    up. A parameter difference also changes the next gradients by about the Hessian times it; the factor 2 allows for
    that feedback over the few steps of a test."""
    return 2 * steps * adam_step_tolerance(lr, eps, grad_tolerance)


def tiny_model_adam_tolerance(lr: float, steps: int, tokens: int, eps: float = TEST_ADAM_EPS) -> float:
    """`adam_parameter_tolerance` for the tests' tiny transformers (hidden size <= 64) trained on `tokens` tokens a
    step: a gradient element sums one term per token and hidden unit, and its terms' absolute sum stays below 1e-2
    (the loss is a mean over the tokens, each token's contribution a product of O(1) activations and O(1/tokens)
    output gradients)."""
    grad_tolerance = sum_tolerance(n_terms=64 * tokens, magnitude=1e-2)
    return adam_parameter_tolerance(lr, eps, steps, grad_tolerance)
