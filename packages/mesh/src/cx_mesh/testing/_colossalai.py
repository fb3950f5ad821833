"""The helpers of `colossalai.testing` that ColossalAI's own tests and scripts use, so those tests run on cx with
only their imports changed. `spawn` itself (which hands a free `port` to functions that launch themselves) lives in
`_spawn.py` beside cx's harness."""

from __future__ import annotations

import functools
import gc
import inspect
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from cx_mesh._accelerator import get_accelerator
from cx_mesh.testing._processes import DistributedTestFailure

__all__ = [
    "assert_close_loose",
    "check_state_dict_equal",
    "clear_cache_before_run",
    "free_port",
    "parameterize",
    "rerun_if_address_is_in_use",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_ADDRESS_IN_USE = ("address already in use", "eaddrinuse")
_LOOSE = 1e-3
"""ColossalAI's `assert_close_loose` tolerance (relative and absolute), which its `check_state_dict_equal` uses."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def parameterize(argument: str, values: Sequence[Any]) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Call the decorated function once per value of `argument` (inside one process, unlike pytest's parametrize).

    Stacked decorators run the full product, as in ColossalAI; an explicitly passed `argument` is not overridden.
    """

    def decorate(function: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(function)
        def each(*args: Any, **kwargs: Any) -> None:
            if argument in kwargs:
                function(*args, **kwargs)
                return
            for value in values:
                function(*args, **{**kwargs, argument: value})

        _drop_parameter(each, function, argument)
        return each

    return decorate


def _drop_parameter(wrapper: Callable[..., Any], function: Callable[..., Any], argument: str) -> None:
    """`wrapper` keeps `function`'s name and docs (`functools.wraps`) but not the parameterized `argument` in its
    signature: pytest asks for every parameter a test's signature names as a fixture, so a ColossalAI test collected
    by pytest failed at setup with "fixture 'use_safetensors' not found" (ColossalAI's own decorator exposes none)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read: nothing for pytest to ask for either
        return
    kept = [parameter for name, parameter in signature.parameters.items() if name != argument]
    wrapper.__signature__ = signature.replace(parameters=kept)  # type: ignore[attr-defined]


def rerun_if_address_is_in_use(max_try: int = 5) -> Callable[[_F], _F]:
    """Run a test again (up to `max_try` times) when it failed only because a rendezvous port was taken."""

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def retried(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_try + 1):
                try:
                    return function(*args, **kwargs)
                except (DistributedTestFailure, RuntimeError, OSError) as error:
                    text = str(error).lower()
                    if attempt == max_try or not any(phrase in text for phrase in _ADDRESS_IN_USE):
                        raise
                    time.sleep(0.1 * attempt)
            return None

        return retried  # type: ignore[return-value]

    return decorate


def clear_cache_before_run() -> Callable[[_F], _F]:
    """Collect garbage and return the device's cached memory before each call (ColossalAI's memory-test hygiene)."""

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def cleared(*args: Any, **kwargs: Any) -> Any:
            gc.collect()
            get_accelerator().empty_cache()
            get_accelerator().reset_peak_memory_stats()
            return function(*args, **kwargs)

        return cleared  # type: ignore[return-value]

    return decorate


def check_state_dict_equal(
    first: object,
    second: object,
    ignore_device: bool = True,
    ignore_dtype: bool = False,
    path: str = "state_dict",
    *,
    exact: bool = False,
) -> None:
    """Assert that two (nested) state dicts hold the same keys and equal values; the error names the first path
    that differs.

    Tensors compare as ColossalAI's helper compares them: within rtol = atol = 1e-3 (its `assert_close_loose`),
    after casting `first` to `second`'s dtype when `ignore_dtype` (else the dtypes must match); `ignore_device`
    moves both to the CPU first. `exact=True` requires bit-equal values instead, for round trips that must lose
    nothing."""
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        if set(first) != set(second):
            missing, extra = sorted(map(str, set(first) - set(second))), sorted(map(str, set(second) - set(first)))
            raise AssertionError(f"{path}: keys differ (only in the first: {missing}; only in the second: {extra})")
        for key in first:
            check_state_dict_equal(
                first[key], second[key], ignore_device, ignore_dtype, f"{path}[{key!r}]", exact=exact
            )
    elif isinstance(first, list | tuple) and isinstance(second, list | tuple):
        if len(first) != len(second):
            raise AssertionError(f"{path}: lengths differ ({len(first)} vs {len(second)})")
        for index, (a, b) in enumerate(zip(first, second, strict=True)):
            check_state_dict_equal(a, b, ignore_device, ignore_dtype, f"{path}[{index}]", exact=exact)
    elif isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        _check_tensors_equal(first, second, ignore_device, ignore_dtype, path, exact)
    elif first != second:
        raise AssertionError(f"{path}: {first!r} != {second!r}")


def _check_tensors_equal(
    first: torch.Tensor, second: torch.Tensor, ignore_device: bool, ignore_dtype: bool, path: str, exact: bool
) -> None:
    a, b = first.detach(), second.detach()
    if ignore_device:
        a, b = a.cpu(), b.cpu()
    if ignore_dtype:
        a = a.to(b.dtype)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{path}: tensors differ ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})")
    if exact:
        if not torch.equal(a, b):
            raise AssertionError(f"{path}: tensors differ (exact=True: values are not bit-equal)")
        return
    try:
        torch.testing.assert_close(a, b, rtol=_LOOSE, atol=_LOOSE)
    except AssertionError as error:
        raise AssertionError(f"{path}: tensors differ beyond rtol=atol={_LOOSE}: {error}") from None


def assert_close_loose(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-3, atol: float = 1e-3) -> None:
    """`torch.testing.assert_close` with loose tolerances, across dtypes and devices (ColossalAI's helper)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, check_dtype=False, check_device=False)
