"""Front-end hook for the probe's forked-engine tests (``run_probe(frontend_hook=FORK_AND_ASYNC)``).

vLLM's CPU build forces two settings in ``CpuPlatform.check_and_update_config``:
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` and ``async_scheduling=False``, whatever was asked. To cover vLLM's
generic fork path and async scheduling on this CPU build, the hook wraps that classmethod in the probe's
front end and puts the requested values back after it ran. A forked EngineCore inherits the wrapper.
`zb-patch doctor --probe` never installs it.
"""

from __future__ import annotations

import os

FORK_AND_ASYNC = f"{__name__}:keep_fork_and_async_scheduling"


def keep_fork_and_async_scheduling() -> list[str]:
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.check_and_update_config.__func__

    def check_and_update_config(klass, vllm_config):
        original(klass, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        vllm_config.scheduler_config.async_scheduling = True

    cls.check_and_update_config = classmethod(check_and_update_config)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return [
        f"{cls.__name__}.check_and_update_config keeps VLLM_WORKER_MULTIPROC_METHOD=fork",
        f"{cls.__name__}.check_and_update_config keeps async_scheduling=True",
    ]
