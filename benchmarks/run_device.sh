#!/usr/bin/env bash
# One run: compiled kernel tests on CUDA, then the benchmarks (incl. the sync-debug check).
# Needs .bench/upstream_vllm.py (python benchmarks/extract_upstream.py, where pip works) carried along.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash benchmarks/run_device.sh [pytest-examples|skip] [bench-runs]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
OUT="${OUT:-/tmp/zb-bench}"
mkdir -p "$OUT"
EXAMPLES="${1:-120}"
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/device.txt"
RUNS="${2:-1}"
if [ "$EXAMPLES" != "skip" ]; then
    echo "=== compiled kernel tests on CUDA (hypothesis examples: $EXAMPLES) ==="
    ZB_PATCH_TEST_KERNEL_EXAMPLES="$EXAMPLES" timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels \
        --durations=5 -rs 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
    echo "pytest rc=${PIPESTATUS[0]}"
fi
for run in $(seq 1 "$RUNS"); do
    echo "=== benchmarks, run $run ==="
    timeout 240 python3 benchmarks/bench_kernels.py --out "$OUT/bench$run.json" 2>&1 | tee "$OUT/bench$run.log" \
        | grep -v '^slot {\|^correction {'
    echo "bench rc=${PIPESTATUS[0]}"
done
