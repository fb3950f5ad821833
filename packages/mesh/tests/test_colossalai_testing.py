"""`colossalai.testing`'s helpers in cx_mesh.testing, used the way ColossalAI's tests use them: a test whose only
change is its imports (spawn(run_dist, n) with run_dist(rank, world_size, port) calling launch itself)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh import launch
from cx_mesh.testing import (
    DistributedTestFailure,
    assert_close_loose,
    check_state_dict_equal,
    clear_cache_before_run,
    parameterize,
    rerun_if_address_is_in_use,
    spawn,
)

SEEN: list[tuple[int, float]] = []


@parameterize("size", [2, 3])
@parameterize("scale", [1.0, 2.0])
def check_all_reduce(size: int, scale: float) -> None:
    SEEN.append((size, scale))
    tensor = torch.full((size,), scale * (dist.get_rank() + 1))
    dist.all_reduce(tensor)
    assert_close_loose(tensor, torch.full((size,), scale * 3.0))


def run_dist(rank: int, world_size: int, port: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ColossalAI's tests ask for nccl: on CPU cx falls back to gloo, warning once
        launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="nccl")
    check_all_reduce()
    assert sorted(SEEN) == [(2, 1.0), (2, 2.0), (3, 1.0), (3, 2.0)]  # the product of both parameterize lists
    dist.barrier()


@rerun_if_address_is_in_use()
@clear_cache_before_run()
def test_colossalai_style_spawn_hands_a_port_and_launch_runs() -> None:
    spawn(run_dist, 2)


def run_with_kwargs(rank: int, world_size: int, port: int, value: int) -> None:
    launch(rank, world_size, "127.0.0.1", port)
    total = torch.tensor([value])
    dist.all_reduce(total)
    assert total.item() == value * world_size
    dist.barrier()


def test_colossalai_style_spawn_with_nprocs_and_kwargs() -> None:
    spawn(run_with_kwargs, nprocs=2, value=5)
    with pytest.raises(ValueError, match="disagree"):
        spawn(run_with_kwargs, 2, nprocs=4, value=5)


def test_parameterize_respects_an_explicit_argument() -> None:
    calls: list[int] = []

    @parameterize("x", [1, 2, 3])
    def record(x: int) -> None:
        calls.append(x)

    record()
    record(x=7)
    assert calls == [1, 2, 3, 7]


def test_rerun_if_address_is_in_use_retries_only_that_failure() -> None:
    attempts: list[int] = []

    @rerun_if_address_is_in_use(max_try=3)
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("The server socket has failed to listen on any local network address: EADDRINUSE")
        return "ran"

    assert flaky() == "ran"
    assert len(attempts) == 3

    @rerun_if_address_is_in_use(max_try=3)
    def broken() -> None:
        attempts.append(1)
        raise RuntimeError("a real failure")

    attempts.clear()
    with pytest.raises(RuntimeError, match="a real failure"):
        broken()
    assert len(attempts) == 1


def test_check_state_dict_equal_names_the_differing_path() -> None:
    first = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "step": 3, "groups": [{"lr": 0.1}]}
    same = {"model": {"w": torch.ones(2), "b": torch.zeros(1)}, "step": 3, "groups": [{"lr": 0.1}]}
    check_state_dict_equal(first, same)
    check_state_dict_equal({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)}, ignore_dtype=True)
    with pytest.raises(AssertionError, match=r"state_dict\['model'\]\['w'\]: tensors differ"):
        check_state_dict_equal(first, {**same, "model": {"w": torch.tensor([1.0, 2.0]), "b": torch.zeros(1)}})
    with pytest.raises(AssertionError, match=r"state_dict\['groups'\]\[0\]\['lr'\]: 0.1 != 0.2"):
        check_state_dict_equal(first, {**same, "groups": [{"lr": 0.2}]})
    with pytest.raises(AssertionError, match="keys differ"):
        check_state_dict_equal(first, {"model": {}})


def test_check_state_dict_equal_is_loose_like_colossalai_unless_exact() -> None:
    """ColossalAI compares tensors with assert_close_loose (rtol = atol = 1e-3), casting the first to the second's
    dtype when ignore_dtype; exact=True keeps bit equality."""
    base = torch.tensor([1.0, -2.0, 300.0])
    near = base + torch.tensor([5e-4, -5e-4, 0.2])  # within atol + rtol * |value| everywhere
    check_state_dict_equal({"w": base}, {"w": near})
    check_state_dict_equal({"opt": [{"m": base}]}, {"opt": [{"m": near}]})
    with pytest.raises(AssertionError, match=r"state_dict\['w'\]: tensors differ \(exact=True"):
        check_state_dict_equal({"w": base}, {"w": near}, exact=True)
    with pytest.raises(AssertionError, match=r"state_dict\['opt'\]\[0\]\['m'\]: tensors differ \(exact"):
        check_state_dict_equal({"opt": [{"m": base}]}, {"opt": [{"m": near}]}, exact=True)
    check_state_dict_equal({"w": base}, {"w": base.clone()}, exact=True)
    far = base + torch.tensor([0.0, 0.0, 0.5])  # 0.5 > 1e-3 + 1e-3 * 300
    with pytest.raises(AssertionError, match=r"state_dict\['w'\]: tensors differ beyond rtol=atol=0.001"):
        check_state_dict_equal({"w": base}, {"w": far})
    # dtypes must match unless ignore_dtype, which casts the first to the second's dtype (not the other way)
    with pytest.raises(AssertionError, match=r"torch.float32 \(3,\) vs torch.float64 \(3,\)"):
        check_state_dict_equal({"w": base}, {"w": near.double()})
    check_state_dict_equal({"w": base}, {"w": near.double()}, ignore_dtype=True)
    rounded_away = torch.tensor([1.003])  # bf16 cannot hold it: it rounds to 1.0 in bf16
    assert torch.equal(rounded_away.bfloat16().float(), torch.tensor([1.0]))
    check_state_dict_equal({"w": rounded_away}, {"w": torch.tensor([1.0], dtype=torch.bfloat16)}, ignore_dtype=True)
    with pytest.raises(AssertionError, match="beyond rtol"):  # compared in float32, where 0.003 is too far
        check_state_dict_equal({"w": torch.tensor([1.0], dtype=torch.bfloat16)}, {"w": rounded_away}, ignore_dtype=True)


def test_assert_close_loose_crosses_dtypes_but_not_real_differences() -> None:
    assert_close_loose(torch.ones(3, dtype=torch.bfloat16), torch.ones(3))
    with pytest.raises(AssertionError):
        assert_close_loose(torch.ones(3), torch.full((3,), 1.1))


def _fails_on_rank_one(rank: int, world_size: int, port: int) -> None:
    launch(rank, world_size, "127.0.0.1", port)
    if rank == 1:
        raise ValueError("rank one failed")
    dist.barrier()


def test_colossalai_style_spawn_reports_failures_by_rank() -> None:
    with pytest.raises(DistributedTestFailure, match="rank one failed"):
        spawn(_fails_on_rank_one, 2, timeout=30)


def test_colossalai_decorators_under_pytest_collection(tmp_path: Path) -> None:
    """A ColossalAI test module (imports changed only) whose test functions are decorated with `parameterize` and
    `clear_cache_before_run`, collected and run by pytest itself: the parameterized arguments are not fixtures (they
    failed at setup with "fixture 'use_safetensors' not found" while the decorators copied the whole signature)."""
    (tmp_path / "test_colossalai_style.py").write_text(
        "from cx_mesh.testing import clear_cache_before_run, parameterize\n"
        "SEEN = []\n\n"
        "@clear_cache_before_run()\n"
        "@parameterize('use_safetensors', [True, False])\n"
        "@parameterize('shard', [1, 2])\n"
        "def test_unsharded_checkpoint(use_safetensors: bool, shard: int):\n"
        "    SEEN.append((use_safetensors, shard))\n\n"
        "def test_all_cases_ran():\n"
        "    assert sorted(SEEN) == [(False, 1), (False, 2), (True, 1), (True, 2)]\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_colossalai_style.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "2 passed" in result.stdout
    assert list(inspect.signature(parameterize("a", [1])(lambda a, b: None)).parameters) == ["b"]
