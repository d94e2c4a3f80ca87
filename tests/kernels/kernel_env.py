"""Shared set-up for the kernel tests (imported by conftest.py and the test modules).

Where the Triton kernels run:
* ``TRITON_INTERPRET=1`` (CI, tox envs ``kernels`` / ``kernels-ascend``): Triton's interpreter on CPU
  tensors;
* otherwise, with a CUDA device (the GPU machine): compiled, on CUDA tensors;
* otherwise the kernel tests are skipped (the reference-only tests still run).

``ZB_PATCH_TEST_KERNEL_EXAMPLES`` overrides the number of hypothesis examples per property test
(the interpreter is slow; the GPU run uses more).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
    TRITON_WHY = ""
except Exception as exc:  # noqa: BLE001 - any import failure means: no Triton here
    HAVE_TRITON = False
    TRITON_WHY = f"triton is not importable ({exc!r})"


def _kernel_device() -> tuple[str | None, str]:
    if not HAVE_TRITON:
        return None, TRITON_WHY
    if INTERPRET:
        return "cpu", ""
    if torch.cuda.is_available():
        return "cuda", ""
    return None, "Triton kernels need TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device; neither is present"


KERNEL_DEVICE, KERNEL_SKIP_REASON = _kernel_device()
requires_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason=KERNEL_SKIP_REASON or "no kernel device")


def examples(default: int) -> int:
    value = os.environ.get("ZB_PATCH_TEST_KERNEL_EXAMPLES")
    return int(value) if value else default


@pytest.fixture
def dev() -> str:
    if KERNEL_DEVICE is None:
        pytest.skip(KERNEL_SKIP_REASON)
    return KERNEL_DEVICE
