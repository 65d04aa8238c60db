#!/usr/bin/env bash
# The GPU check, as one script for one short call on a lent GPU machine (DEVELOPERS.md says
# how to run it; it fits the ~10 minutes of one call): the verify attention backends checked
# against jax's dense reference and timed (benchmarks/gpu_attention_check.py), then the
# decoder's own round on a random-weight Qwen3-8B in bf16 (R = 64 slots, γ = 7, a 5-layer
# DSpark drafter, max_len 4096) with each attention backend at B = R + K = 64, 288 and 512
# verify rows, measured SPS(B) beside the roofline's floor-modelled round for the GPU found
# (benchmarks/verify_cost.py --modelled-chip). The machine's image brings its own jax
# (CUDA); wheels for anything it lacks travel in .whl/ (installed to /tmp/site first).
# Results go to $OUT (default benchmarks/results), named by GPU (h100 / h200) and backend;
# each stage has its own time limit and writes what it measured as it goes.
#
#     OUT=/tmp/out bash scripts/device_gpu_check.sh
#     SMOKE=1 OUT=/tmp/out bash scripts/device_gpu_check.sh   # tiny shapes: the flow, on CPU
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
start=$SECONDS

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$gpu" in
    *H200*) chip=H200 ;;
    *H100*) chip=H100 ;;
    *) chip=H100 ;;  # the modelled floor needs a chip; SMOKE runs name none
esac
tag=$(echo "$chip" | tr 'A-Z' 'a-z')
env_file="$OUT/device_${tag}_env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    >"$env_file" 2>&1
$PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
    >>"$env_file" 2>&1
cat "$env_file"

if [ -n "${SMOKE:-}" ]; then
    check_args=(--quick)
    model_args=(--preset tiny --dtype float32 --slots 4 --max-len 128 --drafter-layers 1
        --budgets 0,6,12 --contexts 100,1)
    backends="xla"
else
    check_args=()
    # K = 0 / 224 / 448 drafts verified: B = 64 / 288 / 512 rows in the verify pass.
    model_args=(--preset qwen3-8b --dtype bfloat16 --slots 64 --max-len 4096
        --drafter-layers 5 --budgets 0,224,448 --contexts 4080,1)
    backends="pallas_gpu xla"
fi

timeout -s KILL "${CHECK_LIMIT:-120}" $PY benchmarks/gpu_attention_check.py "${check_args[@]}" \
    --out "$OUT/gpu_attention_$tag.json" 2>&1 | tee "$OUT/gpu_attention_$tag.log"
kernel_ok=$($PY -c "import json, sys; print(int(bool(json.load(open(sys.argv[1])).get('pallas_gpu_ok'))))" \
    "$OUT/gpu_attention_$tag.json" 2>/dev/null || echo 0)
echo "[device] pallas_gpu kernel matched the reference: $kernel_ok ($((SECONDS - start)) s in)"

# Each backend gets an equal share of what is left of TOTAL_LIMIT (a call's ~10 minutes).
set -- $backends
for backend in $backends; do
    if [ "$backend" = pallas_gpu ] && [ "$kernel_ok" != 1 ]; then
        echo "[device] skipping the pallas_gpu round: the kernel check failed"
        shift
        continue
    fi
    left=$((${TOTAL_LIMIT:-560} - (SECONDS - start)))
    share=$((left / $#))
    shift
    if [ "$share" -lt 60 ]; then
        echo "[device] no time left for the $backend round (${left} s)"
        continue
    fi
    echo "[device] the 8B round with attention=$backend (limit $share s)"
    timeout -s KILL "$share" $PY benchmarks/verify_cost.py "${model_args[@]}" \
        --modelled-chip "$chip" --no-feature-draft --no-anatomy --repeats 10 \
        --attention "$backend" --out "$OUT/verify_cost_${tag}_$backend.json" \
        2>&1 | tee "$OUT/verify_cost_${tag}_$backend.log"
done
echo "[device] done in $((SECONDS - start)) s"
