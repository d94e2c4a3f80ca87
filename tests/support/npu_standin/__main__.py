"""``python -m npu_standin [--family F] <module> [args...]``: run ``<module>`` as ``__main__``
with the NPU stand-in active (e.g. ``python -m npu_standin zb_patch.cli doctor --json``).

``python -m npu_standin --imports``: import the worker-side modules (ascend_imports) and print them.
"""

from __future__ import annotations

import runpy
import sys

USAGE = "usage: python -m npu_standin [--family F] (<module> [args...] | --imports)"


def main(argv: list[str]) -> int:
    family = None
    if argv[:1] == ["--family"]:
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        family, argv = argv[1], argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 0 if argv else 2

    import npu_standin

    active = npu_standin.install(family)
    if argv[0] == "--imports":
        from npu_standin.ascend_imports import import_worker_modules

        for name in import_worker_modules():
            print(name)
        print(f"npu_standin: family {active}: all worker modules imported", file=sys.stderr)
        return 0

    module, args = argv[0], argv[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
