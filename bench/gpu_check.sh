#!/usr/bin/env bash
# One prepared device check for a single lent H200 (fits in 9 minutes). Usage:
#
#   bench/gpu_check.sh OUTDIR             # on the GPU machine, from the repository root
#   bench/gpu_check.sh --dry-run OUTDIR   # the same stages on CPU: Triton interpreter, tiny shapes
#
# Stages, each under its own `timeout` so one failure or hang does not stop the rest; everything is
# written under OUTDIR (one log per stage, the stages' JSON, summary.txt with each stage's exit code
# and seconds):
#   env       GPU (nvidia-smi) and package versions
#   tests     the CUDA tests, compiled (RELIBRA_TEST_DEVICE=cuda): tests/e2e/test_kernels_cuda.py and the
#             multi-process suites (world-size-1 cases on one GPU, the others skip with the reason)
#   kernels   bench/kernels.py at the Qwen3-30B-A3B and Qwen3-235B-A22B expert shapes
#   layer     bench/moe_layer_gpu.py: ReplayBalancedMoE and the expert side with replica slots at the
#             30B layer shape, against an eager per-expert loop and torch._grouped_mm experts
#   graph     bench/cuda_graph.py: CUDA-graph capture + replay of routing -> permute -> MLP -> combine
#   replay_graph bench/replay_graph.py: a single-rank stack of replayed ReplayBalancedMoE layers captured in a
#             CUDA graph, replayed with another micro-batch's schedules; captured vs eager forward time
#   calibrate relibra calibrate: grouped-GEMM curve and attention rate at the Qwen3-30B-A3B shapes (NVLink
#             all-to-all bandwidth and latency when 2+ GPUs) into OUTDIR/cluster_profile.json, the rest from h200
#             (--dry-run: the preset's profile, nothing measured)
# Exit code: 0 when every stage passed, else 1 (summary.txt says which).
set -u

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: $0 [--dry-run] OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || PY=python

GPU_TESTS="tests/e2e/test_kernels_cuda.py tests/layers/test_testing.py tests/layers/test_moe.py tests/layers/test_dispatch.py
tests/layers/test_relayout.py tests/layers/test_replica_buffer.py tests/integrations/test_hf_families.py"
if [ $DRY = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""   # the CPU path everywhere, also on a machine with a GPU
    # stage limits (s): generous for a loaded CPU; the dry run itself takes well under a minute unloaded
    T_ENV=60; T_TESTS=90; T_KERNELS=120; T_LAYER=90; T_GRAPH=90; T_RGRAPH=90; T_CALIBRATE=60
    GPU_TESTS="tests/e2e/test_kernels_cuda.py"  # collects and skips without CUDA: checks the stage's invocation
    KERNEL_ARGS="--dtypes bfloat16"
    LAYER_ARGS="--tiny"
    GRAPH_ARGS="--tiny"
    RGRAPH_ARGS="--tiny"
    CALIBRATE_ARGS="--dry-run"
else
    # 20 + 130 + 170 + 80 + 50 + 30 + 60 = 540 s of stage limits, inside 9 minutes with start-up
    T_ENV=20; T_TESTS=130; T_KERNELS=170; T_LAYER=80; T_GRAPH=50; T_RGRAPH=30; T_CALIBRATE=60
    KERNEL_ARGS=""
    LAYER_ARGS=""
    GRAPH_ARGS=""
    RGRAPH_ARGS=""
    CALIBRATE_ARGS="--iters 5"
fi

SUMMARY="$OUT/summary.txt"
echo "gpu_check $( [ $DRY = 1 ] && echo '--dry-run ' )$(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)" >"$SUMMARY"
FAILED=0

stage() {  # stage NAME SECONDS CMD...: run CMD under `timeout`, log to OUTDIR/NAME.log, record rc and time
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0))
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        echo "$name rc=$rc (timed out after ${limit}s) ${dt}s" >>"$SUMMARY"
    else
        echo "$name rc=$rc ${dt}s" >>"$SUMMARY"
    fi
    [ $rc = 0 ] || FAILED=1
    tail -n 25 "$OUT/$name.log"
}

ENV_PY='import json, sys
sys.path.insert(0, "bench")
import common  # noqa: E402 - its environment(): device, python, torch, triton, CUDA runtime
info = common.environment()
for mod in ("transformers", "numpy", "hypothesis", "pytest"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as exc:
        info[mod] = f"missing: {type(exc).__name__}"
print(json.dumps(info, indent=1))'
env_info() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || echo "nvidia-smi: not available"
    "$PY" -c "$ENV_PY" | tee "$OUT/env.json"
}

export -f env_info
export ENV_PY OUT PY
stage env "$T_ENV" bash -c env_info
# shellcheck disable=SC2086
stage tests "$T_TESTS" env RELIBRA_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -rs \
    --junitxml="$OUT/tests.xml" $GPU_TESTS
# shellcheck disable=SC2086
stage kernels "$T_KERNELS" "$PY" bench/kernels.py --out "$OUT/kernels.json" $KERNEL_ARGS
# shellcheck disable=SC2086
stage layer "$T_LAYER" "$PY" bench/moe_layer_gpu.py --out "$OUT/layer.json" $LAYER_ARGS
# shellcheck disable=SC2086
stage graph "$T_GRAPH" "$PY" bench/cuda_graph.py --out "$OUT/graph.json" $GRAPH_ARGS
# shellcheck disable=SC2086
stage replay_graph "$T_RGRAPH" "$PY" bench/replay_graph.py --out "$OUT/replay_graph.json" $RGRAPH_ARGS
# shellcheck disable=SC2086
stage calibrate "$T_CALIBRATE" "$PY" -m relibra_moe.cli calibrate --model qwen3-30b-a3b --preset h200 \
    --out "$OUT/cluster_profile.json" $CALIBRATE_ARGS

echo "== summary"
cat "$SUMMARY"
exit $FAILED
