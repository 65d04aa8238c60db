#!/usr/bin/env bash
# The GPU check of the attention/caching work, as one script for a short lease on a GPU
# machine whose image already holds jax (CUDA) and flax: the Pallas GPU verify kernel
# checked against the dense reference and timed against the XLA backend, then the
# verify-cost benchmark on a random-weight Qwen3-8B in bf16 (R = 64, γ = 7, a 5-layer
# DSpark drafter, max_len 4096) with the H200's floor-modelled round beside the measured
# one. Results go to $OUT (default benchmarks/results); each stage has its own time limit
# and writes what it measured as it goes.
#
#     OUT=/tmp/out bash scripts/device_verify_cost.sh
#     SMOKE=1 OUT=/tmp/out bash scripts/device_verify_cost.sh   # tiny shapes: the flow, on CPU
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
start=$SECONDS

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >"$OUT/device_env.txt" 2>&1
$PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
    >>"$OUT/device_env.txt" 2>&1
cat "$OUT/device_env.txt"

if [ -n "${SMOKE:-}" ]; then
    check_args=(--quick)
    model_args=(--preset tiny --dtype float32 --slots 4 --max-len 128 --drafter-layers 1
        --budgets 0,14,28 --contexts 100,1)
else
    check_args=()
    model_args=(--preset qwen3-8b --dtype bfloat16 --slots 64 --max-len 4096
        --drafter-layers 5 --budgets 0,224,448 --contexts 4080,1024,1)
fi

timeout "${CHECK_LIMIT:-150}" $PY benchmarks/gpu_attention_check.py "${check_args[@]}" \
    --out "$OUT/gpu_attention_h200.json" 2>&1 | tee "$OUT/gpu_attention_h200.log"
attention=$($PY -c "import json, sys; r = json.load(open(sys.argv[1])); \
print('pallas_gpu' if r.get('pallas_gpu_ok') else 'xla')" "$OUT/gpu_attention_h200.json" \
    2>/dev/null || echo xla)
echo "[device] verify attention backend: $attention ($((SECONDS - start)) s in)"

verify_cost() {
    timeout "$1" $PY benchmarks/verify_cost.py "${model_args[@]}" \
        --modelled-chip H200 --no-feature-draft --no-anatomy --repeats 10 --attention "$2" --out "$OUT/verify_cost_h200_$2.json" \
        2>&1 | tee "$OUT/verify_cost_h200_$2.log"
    return "${PIPESTATUS[0]}"
}
verify_cost "${VERIFY_LIMIT:-400}" "$attention"
rc=$?
left=$((${TOTAL_LIMIT:-570} - (SECONDS - start)))
if [ "$rc" != 0 ] && [ "$attention" = pallas_gpu ] && [ "$left" -gt 120 ]; then
    echo "[device] the pallas_gpu run failed (rc $rc); again with the XLA backend (${left} s left)"
    verify_cost "$((left - 10))" xla
fi
echo "[device] done in $((SECONDS - start)) s"
