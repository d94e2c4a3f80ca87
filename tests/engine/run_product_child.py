"""The product's engine child (``python -m zb_patch.check.engine.child``), as ``zb-patch selftest --engine`` runs it
on a host with an NPU, on a host without one: no NPU op emulation, no worker double, vLLM's and vllm-ascend's own
worker. Only what ``import torch_npu`` itself does at import time is done here, since the real package cannot be
imported without CANN:

- the NPU stand-in (tests/support/npu_standin: the torch_npu / torch.npu names; every runtime call raises);
- the PrivateUse1 backend named "npu" (so ``torch.device("npu")`` parses, as vLLM's DeviceConfig needs);
- vLLM's model-inspection subprocess started through the stand-in (a fresh interpreter needs it too).

The run must get as far as the first call that needs the NPU itself (tests/engine/test_engine.py asserts where).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))


def main(argv: list[str]) -> int:
    import npu_standin

    npu_standin.install()
    import torch
    import torch_npu  # noqa: F401  (the stand-in)

    torch.utils.rename_privateuse1_backend("npu")
    import vllm.model_executor.models.registry as model_registry

    model_registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "npu_standin", "vllm.model_executor.models.registry"]
    from zb_patch.check.engine import child

    return child.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
