#!/usr/bin/env bash
# Re-runs every benchmark whose figures depend on the bundled weights, after
# scripts/build_bundled_models.sh has rebuilt them, in the order BENCHMARKS.md reads them,
# then regenerates BENCHMARKS.md. Results that depend only on shapes or the compiler
# (verify cost, compile time, AOT memory, rooflines, round time, KV memory, start-up,
# soak) are not re-run here. Hours on 2 CPU cores; each stage overwrites its own result
# file, so after an interruption re-run from the stage that did not finish.
set -euo pipefail
cd "$(dirname "$0")/.."

DRAFTERS=(--drafter assets/drafters/dspark --drafter assets/drafters/dspark-rnn
          --drafter assets/drafters/dflash --drafter assets/drafters/eagle3
          --drafter assets/drafters/mtp1)
SETS=../shared/eval_datasets

# Acceptance (Table 1 analog; per-prompt and round-pooled τ, loop shares), T = 0 and 1.
python -m dspark_jax.eval acceptance --target assets/target "${DRAFTERS[@]}" \
    --prompts "$SETS/humaneval.jsonl" --prompts "$SETS/mbpp.jsonl" \
    --temperature 0.0 1.0 --gamma 7 --max-new-tokens 64 --limit 24 --slots 12 \
    --out benchmarks/results/acceptance.json
python -m dspark_jax.eval acceptance --target assets/target "${DRAFTERS[@]}" \
    --prompts "$SETS/gsm8k.jsonl" --prompts "$SETS/math500.jsonl" \
    --prompts "$SETS/mt-bench.jsonl" --prompts "$SETS/aime25.jsonl" \
    --temperature 0.0 1.0 --gamma 7 --max-new-tokens 64 --limit 8 --slots 8 \
    --out benchmarks/results/acceptance_other_sets.json
python -m dspark_jax.eval acceptance --target assets/target "${DRAFTERS[@]}" \
    --prompts "$SETS/humaneval.jsonl" --prompts "$SETS/mbpp.jsonl" \
    --temperature 1.0 --gamma 7 --max-new-tokens 64 --limit 24 --slots 12 \
    --verification standard coupled --out benchmarks/results/acceptance_coupled.json
# Reliability diagrams and the static-threshold sweep (Figs. 5/6 analogs).
python -m dspark_jax.eval plot --results benchmarks/results/acceptance.json \
    --out-dir benchmarks/results/figs

# Drafter quality vs data, and the controlled runs against EAGLE-3 (each trains drafters).
# A drafter checkpoint records its target's weights and refuses to resume against others,
# so runs trained against the previous target start afresh; the target-strength runs
# (*_v1, against assets/target_v1) do not depend on the bundled target and are kept.
ABLATION=(eagle3_steps dspark_2x dspark_768 eagle3_768 dspark_l5 dflash_l5 dspark_g4 eagle3_g4
          dspark_r64 dspark_decay7 dspark_4x eagle3_4x)
rm -rf workdirs/data_curve "${ABLATION[@]/#/workdirs/ablation/}"
python benchmarks/drafter_data_curve.py --records 768 1536 3072
python benchmarks/drafter_ablation.py --runs dspark dspark_rnn dflash eagle3 mtp1 "${ABLATION[@]}"
# Draft depth, decoded: the 5-layer DSpark and DFlash runs beside the bundled 2-layer ones.
for run in dspark_l5 dflash_l5; do
    python -m dspark_jax.export --workdir "workdirs/ablation/$run" \
        --out "workdirs/drafters/${run/_/-}" --dtype bfloat16
done
python -m dspark_jax.eval acceptance --target assets/target --drafter assets/drafters/dspark \
    --drafter workdirs/drafters/dspark-l5 --drafter assets/drafters/dflash \
    --drafter workdirs/drafters/dflash-l5 \
    --prompts "$SETS/humaneval.jsonl" --prompts "$SETS/mbpp.jsonl" \
    --temperature 1.0 --gamma 7 --max-new-tokens 64 --limit 24 --slots 12 \
    --out benchmarks/results/acceptance_depth.json

# Greedy share in the distilled data: every fourth train batch greedy, same recipe; decoded
# beside the bundled DSpark at T = 0 and 1.
rm -rf data/distill_greedy25 workdirs/ablation/dspark_greedy25
python -m dspark_jax.data.distill --target assets/target --corpus-dir data/stdlib \
    --out-dir data/distill_greedy25 --prompt-len 128 --max-new-tokens 256 --max-prompts 3072 \
    --batch-size 32 --temperature 1.0 --seed 0 --greedy-share 0.25
python benchmarks/drafter_ablation.py --runs dspark_greedy25
python -m dspark_jax.export --workdir workdirs/ablation/dspark_greedy25 \
    --out workdirs/drafters/dspark-greedy25 --dtype bfloat16
python -m dspark_jax.eval acceptance --target assets/target --drafter assets/drafters/dspark \
    --drafter workdirs/drafters/dspark-greedy25 \
    --prompts "$SETS/humaneval.jsonl" --prompts "$SETS/mbpp.jsonl" \
    --temperature 0.0 1.0 --gamma 7 --max-new-tokens 64 --limit 24 --slots 12 \
    --out benchmarks/results/acceptance_greedy_share.json

# Serving under load (Figs. 7-8 analog), greedy and T = 1, the simulator's validation
# against it, and the simulator on modelled TPU.
SERVING=(--target assets/target --drafter assets/drafters/dspark
         --mtp-drafter assets/drafters/mtp1 --concurrency 1,2,4,8,16,32,64 --time-limit 15
         --max-tokens 48 --slots 16 --requests-per-client 4)
python benchmarks/serving.py "${SERVING[@]}"
python benchmarks/serving.py "${SERVING[@]}" --temperature 1
python benchmarks/serving_sim.py --validate
# Serving on modelled v5p: replays the T = 1 acceptance records with the host time per round
# the CPU serving run just measured.
python benchmarks/serving_sim.py

python benchmarks/summarize.py
