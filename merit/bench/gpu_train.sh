#!/usr/bin/env bash
# The branch trainer's GPU figures in one go, on one GPU: `merit bench train --device cuda --size 3b`
# with the shipped 3B config's packed batches (and a profile of 5 steps), then padded batches, the
# generated Vision-FLAN-shaped corpus packed and padded, the dense block mask (sdpa) for packed
# rows, and each fused kernel off in turn (transformers has no FlexAttention for Qwen2.5-VL). Every run's JSON line goes to $OUT/lines.jsonl, its output to
# $OUT/<name>.log, the profile to $OUT/profile.md. Runs in that order until $BUDGET_S seconds have
# passed (default: all of them); STEPS sets the steps of each (default 20).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/bench-gpu}
steps=${STEPS:-20}
budget=${BUDGET_S:-100000}
mkdir -p "$out"
start=$SECONDS

bench() {
    local name=$1
    shift
    if ((SECONDS - start > budget)); then
        echo "$name: not run (over ${budget} s)" | tee -a "$out/skipped.txt"
        return
    fi
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >"$out/$name.gpu.txt" 2>&1
    merit bench train configs/demo.yaml --run-dir "$out/run" --device cuda --size 3b --steps "$steps" "$@" \
        >"$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s"
    grep '^{' "$out/$name.log" | sed "s/^{/{\"run\": \"$name\", /" >>"$out/lines.jsonl"
}

bench packed --profile 5
cp "$out/run/bench/train/trainer/profile.md" "$out/profile.md" 2>/dev/null
bench padded --set train.packing=false
bench vision-flan --corpus vision-flan
bench vision-flan-padded --corpus vision-flan --set train.packing=false
bench packed-sdpa --set train.packed_attention=sdpa
bench foreach-adamw --set train.fused_optimizer=false
bench no-liger --set train.liger_kernel=false
