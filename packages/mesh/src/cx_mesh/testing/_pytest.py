"""`@distributed(world_size=...)`: write a multi-rank test as `def test_x(rank, world_size, ...)`.

The decorated function runs on every rank; pytest sees a test taking only the remaining parameters, so
`@pytest.mark.parametrize` and fixtures with picklable values (e.g. `tmp_path`) work as usual. A tuple of world sizes
parametrises the test over them. By default tests share a pool of long-lived ranks; `fresh=True` runs the test on
new processes (for tests that initialise torch.distributed themselves or change process-wide state).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cx_mesh.testing._pool import run_in_pool
from cx_mesh.testing._spawn import default_timeout, spawn
from cx_mesh.testing._worker import INNER_ATTRIBUTE, FunctionRef

__all__ = ["distributed"]

_F = TypeVar("_F", bound=Callable[..., Any])


def distributed(
    world_size: int | Sequence[int] = 2,
    *,
    backend: str = "gloo",
    timeout: float | None = None,
    fresh: bool = False,
    threads: int = 1,
    init_process_group: bool = True,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make `function(rank, world_size, **params)` a pytest test that runs on `world_size` ranks."""
    sizes = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"distributed: world sizes must be positive, got {world_size!r}")
    use_pool = not fresh and init_process_group

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(function)
        parameters = list(signature.parameters.values())
        if [p.name for p in parameters[:2]] != ["rank", "world_size"]:
            raise TypeError(f"{function.__qualname__}: a @distributed test must start with (rank, world_size, ...)")
        reference = FunctionRef.of(function)

        def run(size: int, kwargs: dict[str, Any]) -> None:
            timeout_s = default_timeout(size) if timeout is None else timeout
            if use_pool:
                outcomes = run_in_pool(reference, size, kwargs, backend=backend, timeout=timeout_s, threads=threads)
            else:
                outcomes = spawn(
                    function,
                    size,
                    backend=backend,
                    timeout=timeout_s,
                    threads=threads,
                    init_process_group=init_process_group,
                    **kwargs,
                )
            reasons = {o.skipped for o in outcomes.values()}
            if None not in reasons:  # every rank skipped: so does the test
                import pytest

                pytest.skip("; ".join(sorted(r for r in reasons if r is not None)))

        rest = parameters[2:]
        if len(sizes) == 1:

            @functools.wraps(function)
            def single(**kwargs: Any) -> None:
                run(sizes[0], kwargs)

            single.__signature__ = signature.replace(parameters=rest)  # type: ignore[attr-defined]
            wrapper: Callable[..., None] = single
        else:
            import pytest

            @functools.wraps(function)
            def several(world_size: int, **kwargs: Any) -> None:
                run(world_size, kwargs)

            size_parameter = inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            several.__signature__ = signature.replace(parameters=[size_parameter, *rest])  # type: ignore[attr-defined]
            wrapper = pytest.mark.parametrize("world_size", sizes)(several)
        setattr(wrapper, INNER_ATTRIBUTE, function)
        return wrapper

    return decorate
