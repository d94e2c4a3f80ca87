#!/usr/bin/env bash
# What the GPU machine offers, before building the carried stack for it (docs/environments.md, "GPU machine"): the Python
# version (benchmarks/gpu_stack.py --python must match it), the installed packages, the GPU, torch / triton, glibc,
# and which of the modules the engine path imports are there already. Writes $OUT/probe.txt and $OUT/box-freeze.txt.
# Usage (repo root, on the GPU machine; device tool: command="bash benchmarks/gpu_probe.sh"): OUT=/some/dir bash ...
set -u
OUT="${OUT:-/tmp/zb-probe}"
mkdir -p "$OUT"
{
    echo "=== python"
    command -v python3 python3.10 python3.11 python3.12 python3.13 python 2>/dev/null
    python3 -c 'import sys, sysconfig; print(sys.version); print("executable", sys.executable); print("abi", sysconfig.get_config_var("SOABI"))'
    echo "=== glibc"
    ldd --version 2>&1 | head -1
    python3 -c 'import platform; print(platform.libc_ver())'
    echo "=== GPU"
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    echo "=== torch / triton / numpy"
    python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else ""); print("triton", triton.__version__)' 2>&1
    python3 -c 'import numpy; print("numpy", numpy.__version__)' 2>&1
    echo "=== stdlib modules the stack needs (tarfile xz, sqlite for diskcache)"
    python3 -c 'import lzma, sqlite3, ssl, ctypes; print("lzma sqlite3 ssl ctypes: ok")' 2>&1
    echo "=== importable already (find_spec; the stack carries its own copy of most of these)"
    python3 - <<'EOF'
import importlib.util
names = ["numpy", "setuptools", "typing_extensions", "filelock", "fsspec", "jinja2", "sympy", "networkx", "pytest",
         "hypothesis", "packaging", "wrapt", "yaml", "requests", "PIL", "pydantic", "pydantic_core", "msgspec", "zmq",
         "cbor2", "regex", "psutil", "safetensors", "tokenizers", "transformers", "huggingface_hub", "numba", "scipy",
         "cv2", "xgrammar", "llguidance", "openai", "aiohttp", "vllm", "vllm_ascend"]
for n in names:
    try:
        found = importlib.util.find_spec(n) is not None
    except Exception as exc:  # a broken package counts as absent
        found = f"error: {exc}"
    print(f"{n:20s} {found}")
EOF
    echo "=== disk / memory / cpus"
    df -h . 2>&1 | tail -1
    free -g 2>&1 | head -2
    nproc
} 2>&1 | tee "$OUT/probe.txt"
python3 -m pip list --format=freeze > "$OUT/box-freeze.txt" 2>&1 || python3 -c 'import importlib.metadata as m; print("\n".join(sorted(f"{d.metadata[\"Name\"]}=={d.version}" for d in m.distributions())))' > "$OUT/box-freeze.txt"
echo "=== $(wc -l < "$OUT/box-freeze.txt") installed distributions: $OUT/box-freeze.txt"
