"""Extract the upstream pieces the benchmarks compare against, from a vLLM wheel, into .bench/.

Run on a machine with network (the GPU machine has none), before a benchmark run::

    python benchmarks/extract_upstream.py                 # pip-downloads vllm==0.23.0 (no deps)
    python benchmarks/extract_upstream.py --wheel PATH    # or use a wheel you already have

It writes ``.bench/upstream_vllm.py`` (git-ignored, never committed) holding, verbatim from the
wheel: ``_compute_slot_mapping_kernel`` from ``vllm/v1/worker/block_table.py`` and the body of
``update_num_computed_tokens_for_batch_change`` from ``vllm/v1/spec_decode/utils.py``, with plain
``triton`` / ``torch`` imports instead of vLLM's.  The benchmark applies ``torch.compile`` to the
latter the way vLLM does (``dynamic=True``; CUDA's ``simple_compile_backend`` is inductor).
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(os.path.dirname(HERE), ".bench")
SOURCES = {
    "vllm/v1/worker/block_table.py": ["_compute_slot_mapping_kernel"],
    "vllm/v1/spec_decode/utils.py": ["update_num_computed_tokens_for_batch_change"],
}


def _function_source(text: str, name: str, *, keep_decorators: bool) -> str:
    tree = ast.parse(text)
    lines = text.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = node.decorator_list[0].lineno if (keep_decorators and node.decorator_list) else node.lineno
            return "\n".join(lines[start - 1 : node.end_lineno]) + "\n"
    raise SystemExit(f"{name} not found")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", help="path to a vllm wheel (default: pip download vllm==VERSION)")
    ap.add_argument("--version", default="0.23.0")
    args = ap.parse_args()
    wheel = args.wheel
    if wheel is None:
        tmp = tempfile.mkdtemp()
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, f"vllm=={args.version}"]
        )
        wheel = glob.glob(os.path.join(tmp, "vllm-*.whl"))[0]
    with open(wheel, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    with zipfile.ZipFile(wheel) as zf:
        texts = {path: zf.read(path).decode() for path in SOURCES}
    parts = [
        f'"""Extracted from {os.path.basename(wheel)} (sha256 {digest[:16]}...) by benchmarks/extract_upstream.py.',
        'Upstream code, Apache-2.0, copyright the vLLM project. Benchmark use only; never committed."""',
        "import torch",
        "import triton",
        "import triton.language as tl",
        "",
        "",
        _function_source(texts["vllm/v1/worker/block_table.py"], "_compute_slot_mapping_kernel", keep_decorators=True),
        "",
        "# torch.compile is applied by the benchmark (vLLM: dynamic=True, backend=simple_compile_backend)",
        _function_source(
            texts["vllm/v1/spec_decode/utils.py"], "update_num_computed_tokens_for_batch_change", keep_decorators=False
        ),
    ]
    os.makedirs(OUT_DIR, exist_ok=True)
    out = os.path.join(OUT_DIR, "upstream_vllm.py")
    with open(out, "w") as fh:
        fh.write("\n".join(parts))
    print(f"wrote {out} from {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
