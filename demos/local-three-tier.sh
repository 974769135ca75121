#!/usr/bin/env bash
# The three tiers as three local processes, step by step, on a model you give
# (default: the demo's digits model, built once and cached by `tierflow demo`).
#   bash demos/local-three-tier.sh [MODEL.onnx IN.npz]
# Needs no activated venv: it uses the repository's .venv (which scripts/demo makes),
# else a `tierflow` on PATH. CLOUD_PORT and EDGE_PORT (default 50052, 50051) move the
# servers; both are stopped when the script ends, however it ends.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -x "$repo/.venv/bin/tierflow" ]; then
    tierflow=$repo/.venv/bin/tierflow
elif command -v tierflow >/dev/null 2>&1; then
    tierflow=$(command -v tierflow)
else
    echo "local-three-tier.sh: tierflow is not installed here; run scripts/demo first" \
        "(it makes $repo/.venv with everything the demo needs)" >&2
    exit 1
fi
cloud_port=${CLOUD_PORT:-50052}
edge_port=${EDGE_PORT:-50051}

work=$(mktemp -d)
pids=()
cleanup() {
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# Start `tierflow serve TIER ...` and wait (up to 60 s) for its "serving" line.
serve() {
    local tier=$1
    shift
    "$tierflow" serve "$tier" "$@" >"$work/$tier.out" 2>"$work/$tier.log" &
    pids+=("$!")
    for _ in $(seq 600); do
        if grep -q " serving plan " "$work/$tier.out"; then
            cat "$work/$tier.out"
            return 0
        fi
        if ! kill -0 "$!" 2>/dev/null; then
            break
        fi
        sleep 0.1
    done
    echo "local-three-tier.sh: the $tier did not start:" >&2
    tail -n 20 "$work/$tier.log" >&2
    exit 1
}

model=${1:-}
input=${2:-}
if [ -z "$model" ]; then
    cache=${TIERFLOW_CACHE:-$HOME/.cache/tierflow}/demo
    python=$(dirname "$tierflow")/python
    [ -x "$python" ] || python=$(head -n 1 "$tierflow" | sed 's/^#!//')
    "$python" -c 'from tierflow.zoo.digits import build_demo_model; build_demo_model()'
    model=$cache/model.onnx
    input=$cache/heldout.npz
fi

"$tierflow" plan "$model" -o "$work/plan" --slowdown device=10 \
    --link device-edge=20mbit,10ms --link edge-cloud=200mbit,20ms

serve cloud --plan "$work/plan" --listen "127.0.0.1:$cloud_port"
serve edge --plan "$work/plan" --listen "127.0.0.1:$edge_port" \
    --upstream "127.0.0.1:$cloud_port"

"$tierflow" run --plan "$work/plan" --edge "127.0.0.1:$edge_port" --input "$input" \
    --output "$work/out.npz" --report "$work/report.jsonl" --slowdown 10
head -n 3 "$work/report.jsonl"
