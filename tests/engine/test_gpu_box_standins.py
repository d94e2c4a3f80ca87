"""The absent-package stand-ins of the GPU host (tests/support/gpu_box/absent: numba, scipy; docs/environments.md "GPU
box"): the names vllm-ascend / vLLM import exist, nothing they stand for runs. Loaded under other names: this env has
the real packages."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest

ABSENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "gpu_box", "absent")


def load(package: str):
    name = f"absent_{package}"
    root = os.path.join(ABSENT, package)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_numba_decorators_keep_the_function_and_refuse_to_run_it():
    numba = load("numba")

    def flashlb_kernel(x):
        return x

    for decorated in (numba.njit(flashlb_kernel), numba.njit(fastmath=True, cache=True)(flashlb_kernel)):
        assert decorated.__name__ == "flashlb_kernel"
        with pytest.raises(RuntimeError, match="numba stand-in: .*flashlb_kernel is numba-compiled"):
            decorated(1)
    assert numba.jit(nopython=True)(flashlb_kernel).__wrapped__ is flashlb_kernel
    for name in ("get_num_threads", "set_num_threads", "prange"):
        with pytest.raises(RuntimeError, match=f"numba stand-in: numba.{name} is not available"):
            getattr(numba, name)(1)
    with pytest.raises(AttributeError, match="numba stand-in: no attribute vectorize"):
        numba.vectorize  # noqa: B018


def test_scipy_names_exist_and_every_use_raises():
    load("scipy")
    stats = importlib.import_module("absent_scipy.stats")
    optimize = importlib.import_module("absent_scipy.optimize")
    with pytest.raises(AttributeError, match="scipy.stats.norm is not available"):
        stats.norm  # noqa: B018
    with pytest.raises(RuntimeError, match="linear_sum_assignment is not available"):
        optimize.linear_sum_assignment([[1.0]])
    with pytest.raises(AttributeError, match="scipy stand-in: no attribute linalg"):
        sys.modules["absent_scipy"].linalg  # noqa: B018
