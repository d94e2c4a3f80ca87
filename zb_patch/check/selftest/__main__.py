"""``python -m zb_patch.check.selftest``: the self-test with developer options.

Same as ``zb-patch selftest`` plus: ``--ks`` (num_speculative_tokens values), ``--modes``,
``--no-plain``, ``--triton`` (run the device ops through the Triton kernels; on CPU that needs
Triton's interpreter), ``--correction {cpu,previous}`` (the device count correction's base), and ``--plant BUG``
(repeatable; switch on a planted bug — the run must then FAIL).  ``--list-plants`` prints the planted bugs.
"""

from __future__ import annotations

import argparse
import sys

from zb_patch.console import run_command

from . import run_cli


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zb_patch.check.selftest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--ks", type=int, nargs="+", default=None)
    p.add_argument("--modes", nargs="+", default=None)
    p.add_argument("--no-plain", action="store_true")
    p.add_argument("--triton", action="store_true")
    p.add_argument(
        "--correction",
        choices=("cpu", "previous"),
        default="cpu",
        help="device count correction: from this step's CPU counts (default) or, as vLLM 0.19+, "
        "from last step's device counts",
    )
    p.add_argument("--plant", action="append", default=None)
    p.add_argument("--list-plants", action="store_true")
    args = p.parse_args(argv)
    if args.list_plants:
        from .runner import PLANTS

        for name, (what, upstream) in PLANTS.items():
            print(f"{name}: {what} [{upstream}]")
        return 0
    return run_command(run_cli, args)


if __name__ == "__main__":
    sys.exit(main())
