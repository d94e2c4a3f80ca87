#!/usr/bin/env bash
# The engine measurements in one run, for one carried stack (benchmarks/gpu_stack.py): the engine on the GPU machine with
# CUDA standing in for the NPU (benchmarks/bench_engine_gpu.py), three parts:
#   stall-*  the first corrected step with a cold Triton cache for zb-patch's kernels (the release's own kernels
#            compiled beforehand by a classic-async run), without and with zb-patch's start-up compilation
#            (bench_engine_gpu's ZB_BENCH_NO_START_COMPILE=1 turns it off), async + ZB_PATCH=1 only; 0.13 / 0.18
#   k1/ k3/  sync / async / async + ZB_PATCH=1 with --device-ms of device time added to every forward, so that a
#            step is device-bound: tokens and counts, synchronisation in the prep window, host and device time
#   race-*   classic async (no zb-patch), k = 3, host-bound, against transformers' tokens: as released, with vLLM's
#            synchronize_input_prep wait added alone (bench_engine_gpu's ZB_BENCH_INPUT_PREP_WAIT=1), and with
#            CUDA_LAUNCH_BLOCKING=1 (no host/device overlap): is a classic async crash a race? (docs/benchmarks.md)
# Writes $OUT/summary.md (every report) and $OUT/suite.tgz (every run's result, log, probe and trace).
# Usage (repo root, on the GPU machine): OUT=/dir bash benchmarks/gpu_engine_suite.sh STACK_DIR [DEVICE_MS] [KS] [PARTS]
#   KS: the k of the device-bound runs, "3 1" by default (each k: ~3 min on an H100)
#   PARTS: "stall bubble" by default (stall: 0.13 / 0.18 only); "race" adds the race-* runs (~1 min each)
#   device tool: carry=["<STACK_DIR>", ".gpu-models.tar.xz"], command="OUT=$OUT bash benchmarks/gpu_engine_suite.sh <STACK_DIR> 40"
set -u
STACK="${1:?stack folder (.gpu-stack, .gpu-stack-023, ...)}"
DEVICE_MS="${2:-40}"
KS="${3:-3 1}"
PARTS=" ${4:-stall bubble} "
OUT="${OUT:-/tmp/zb-gpu-suite}"
# the constructed model needs scipy to be written, which the GPU machine lacks: written here beforehand and carried
MODELS=.gpu-models.tar.xz
[ -f "$MODELS" ] || { echo "no $MODELS: write it first, where scipy is installed:" \
    ".tox/va018/bin/python benchmarks/bench_engine_gpu.py --write-models $MODELS; carry it" >&2; exit 2; }
WORK="$OUT/work"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
release=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['release'])" "$STACK/STACK.json")
bench() {  # name, then bench_engine_gpu.py arguments
    local name=$1; shift
    mkdir -p "$WORK/$name"
    python3 benchmarks/bench_engine_gpu.py --stack "$STACK" --models "$MODELS" --out "$WORK/$name" "$@" \
        > "$WORK/$name/stdout.txt" 2> "$WORK/$name/stderr.txt"
    echo "$name: rc $? ($(date +%T))"
    { echo; echo "# $name (vllm-ascend $release): bench_engine_gpu.py $*"; cat "$WORK/$name/bench_engine_gpu.md"; } \
        >> "$OUT/summary.md" 2>/dev/null
}
echo "vllm-ascend $release, device ms $DEVICE_MS, $(nvidia-smi -L 2>&1 | head -1)" > "$OUT/summary.md"
case "$release" in 0.13.* | 0.18.*) backport=1 ;; *) backport= ;; esac
if [[ "$PARTS" == *" race "* ]]; then
    export TRITON_CACHE_DIR="$WORK/triton-race"
    race="--k 3 --configs async --no-warmup --profile-steps 0 --budget 100"
    bench race-classic $race
    ZB_BENCH_INPUT_PREP_WAIT=1 bench race-input-prep-wait $race
    CUDA_LAUNCH_BLOCKING=1 bench race-launch-blocking $race
fi
if [ -n "$backport" ] && [[ "$PARTS" == *" stall "* ]]; then
    export TRITON_CACHE_DIR="$WORK/triton-release"
    bench release-kernels --k 3 --configs async --no-warmup --profile-steps 0 --no-reference --budget 120
    for variant in without with; do
        rm -rf "$WORK/triton-$variant"; cp -r "$WORK/triton-release" "$WORK/triton-$variant"
        export TRITON_CACHE_DIR="$WORK/triton-$variant"
        if [ "$variant" = without ]; then export ZB_BENCH_NO_START_COMPILE=1; else unset ZB_BENCH_NO_START_COMPILE; fi
        bench "stall-$variant-start-compile" --k 3 --configs async+zb --no-warmup --profile-steps 0 --no-reference --budget 120
    done
    warm=--no-warmup  # the stall runs compiled every kernel into triton-with
else
    export TRITON_CACHE_DIR="$WORK/triton-with"
    warm=
fi
reference=  # transformers' reference tokens: with the first k only
for k in $KS; do
    [[ "$PARTS" == *" bubble "* ]] || break
    [ -z "$warm$reference" ] && budget=280 || budget=200  # warm-up and reference: ~60 s more
    bench "k$k" --k "$k" --device-ms "$DEVICE_MS" $warm $reference --budget $budget
    warm=--no-warmup reference=--no-reference
done
rm -rf "$WORK"/triton-* "$WORK"/*/models
tar czf "$OUT/suite.tgz" -C "$WORK" . && rm -rf "$WORK"
