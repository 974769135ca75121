#!/usr/bin/env bash
# The three tiers as three local processes, step by step, on a model you give
# (default: the demo's digits model, built once and cached by `tierflow demo`).
#   bash demos/local-three-tier.sh [MODEL.onnx IN.npz]
set -euo pipefail
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

model=${1:-}
input=${2:-}
if [ -z "$model" ]; then
    cache=${TIERFLOW_CACHE:-$HOME/.cache/tierflow}/demo
    python -c 'from tierflow.zoo.digits import build_demo_model; build_demo_model()'
    model=$cache/model.onnx
    input=$cache/heldout.npz
fi

tierflow plan "$model" -o "$work/plan" --emulate device=10 \
    --link device-edge=20mbit,10ms --link edge-cloud=200mbit,20ms

tierflow serve cloud --plan "$work/plan" --listen 127.0.0.1:50052 &
tierflow serve edge --plan "$work/plan" --listen 127.0.0.1:50051 --upstream 127.0.0.1:50052 &
sleep 3   # both print a line once they are serving

tierflow run --plan "$work/plan" --edge 127.0.0.1:50051 --input "$input" \
    --output "$work/out.npz" --report "$work/report.jsonl" --slowdown 10
head -n 3 "$work/report.jsonl"
