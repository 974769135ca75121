#!/usr/bin/env bash
# A real, kernel-shaped link between the three tiers on one machine: three network
# namespaces joined by veth pairs, each direction shaped by netem (delay) and tbf (rate).
# Needs root, iproute2 (ip, tc) and the sch_netem / sch_tbf modules. See demos/netns-link.md.
#
#   sudo bash demos/netns-link.sh up [DE_RATE DE_RTT EC_RATE EC_RTT]   # 20mbit 10ms 200mbit 20ms
#   sudo bash demos/netns-link.sh set device-edge 2mbit 30ms           # change a link now
#   sudo bash demos/netns-link.sh replay device-edge uplink.csv        # SECONDS,RATE,RTT lines
#   sudo bash demos/netns-link.sh run [MODEL.onnx IN.npz [PLAN OPTION...]]  # up, plan, serve,
#                                     # run, down; options go to `tierflow plan` (--profile ...)
#   sudo bash demos/netns-link.sh down
#
# Addresses (10.77.0.0/16, only inside the namespaces this script makes):
#   tf-device 10.77.1.1 --- 10.77.1.2 tf-edge 10.77.2.1 --- 10.77.2.2 tf-cloud
set -euo pipefail

DEVICE=tf-device EDGE=tf-edge CLOUD=tf-cloud

# The interfaces that send on a link, as "NAMESPACE:DEVICE", one per direction.
ends() {
    case $1 in
        device-edge) echo "$DEVICE:tf-de0 $EDGE:tf-de1" ;;
        edge-cloud) echo "$EDGE:tf-ec0 $CLOUD:tf-ec1" ;;
        *) echo "unknown link '$1': expected device-edge or edge-cloud" >&2; exit 2 ;;
    esac
}

# Half of an RTT such as 30ms (each direction delays by half), in microseconds for tc.
half_us() {
    awk -v t="$1" 'BEGIN {
        if (!match(t, /^[0-9.]+/)) { print "bad RTT " t > "/dev/stderr"; exit 2 }
        v = substr(t, 1, RLENGTH); u = substr(t, RLENGTH + 1)
        s = (u == "s") ? 1e6 : (u == "ms") ? 1e3 : (u == "us") ? 1 : -1
        if (s < 0) { print "bad RTT unit in " t ": expected s, ms or us" > "/dev/stderr"; exit 2 }
        printf "%dus\n", v * s / 2 }'
}

# Shape one link both ways: netem holds each packet RTT/2, tbf under it paces to RATE.
shape() {  # LINK RATE RTT VERB(add|change)
    local delay end ns dev
    delay=$(half_us "$3")
    for end in $(ends "$1"); do
        ns=${end%%:*} dev=${end#*:}
        if have_netem; then
            ip netns exec "$ns" tc qdisc "$4" dev "$dev" root handle 1: netem delay "$delay" limit 100000
            ip netns exec "$ns" tc qdisc "$4" dev "$dev" parent 1:1 handle 10: \
                tbf rate "$2" burst 64kb latency 2s
        else
            ip netns exec "$ns" tc qdisc "$4" dev "$dev" root handle 10: tbf rate "$2" burst 64kb latency 2s
        fi
    done
    if have_netem; then echo "$1: $2, RTT $3"; else echo "$1: $2 (no netem in this kernel: RTT not shaped)"; fi
}

# Whether this kernel has netem (some VM kernels lack sch_netem; tbf alone then shapes rate).
have_netem() {
    if [ -z "${NETEM:-}" ]; then
        if ip netns exec $DEVICE tc qdisc add dev lo root netem delay 0ms 2>/dev/null; then
            ip netns exec $DEVICE tc qdisc del dev lo root
            NETEM=yes
        else
            NETEM=no
        fi
    fi
    [ "$NETEM" = yes ]
}

up() {
    local ns
    for ns in $DEVICE $EDGE $CLOUD; do
        ip netns add "$ns"
        ip netns exec "$ns" ip link set lo up
    done
    ip link add tf-de0 netns $DEVICE type veth peer name tf-de1 netns $EDGE
    ip link add tf-ec0 netns $EDGE type veth peer name tf-ec1 netns $CLOUD
    ip -n $DEVICE addr add 10.77.1.1/24 dev tf-de0
    ip -n $EDGE addr add 10.77.1.2/24 dev tf-de1
    ip -n $EDGE addr add 10.77.2.1/24 dev tf-ec0
    ip -n $CLOUD addr add 10.77.2.2/24 dev tf-ec1
    ip -n $DEVICE link set tf-de0 up
    ip -n $EDGE link set tf-de1 up
    ip -n $EDGE link set tf-ec0 up
    ip -n $CLOUD link set tf-ec1 up
    # veth offloads would hand tbf 64 KiB super-packets; shape real MTU-sized frames.
    for end in $DEVICE:tf-de0 $EDGE:tf-de1 $EDGE:tf-ec0 $CLOUD:tf-ec1; do
        ip netns exec "${end%%:*}" ethtool -K "${end#*:}" tso off gso off gro off \
            >/dev/null 2>&1 || true
    done
    shape device-edge "${1:-20mbit}" "${2:-10ms}" add
    shape edge-cloud "${3:-200mbit}" "${4:-20ms}" add
}

down() {
    local ns
    for ns in $DEVICE $EDGE $CLOUD; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true  # deleting a namespace removes its veths
    done
}

# Replay a link trace (the format of --link-emulation trace=FILE.csv) with tc.
replay() {  # LINK FILE.csv
    local start seconds rate rtt now wait
    start=$(date +%s.%N)
    grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' -e '^seconds' "$2" | tr -d ' ' |
        while IFS=, read -r seconds rate rtt; do
            now=$(date +%s.%N)
            wait=$(awk -v a="$start" -v s="$seconds" -v n="$now" 'BEGIN { w = a + s - n; print (w > 0 ? w : 0) }')
            sleep "$wait"
            shape "$1" "${rate%%#*}" "${rtt%%#*}" change
        done
}

# Wait until HOST:PORT accepts connections from the device's namespace (at most 60 s).
wait_for() {  # HOST PORT
    for _ in $(seq 600); do
        if ip netns exec $DEVICE bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    echo "nothing serves on $1:$2 after 60 s" >&2
    return 1
}

# The emulated tiers of `tierflow demo`: a device 20x slower than this machine, an edge
# 2x; the plan is made for them and for the links `up` shapes by default.
DEVICE_SLOWDOWN=20 EDGE_SLOWDOWN=2
WORK=

run() {  # [MODEL.onnx IN.npz [PLAN OPTION...]]
    local model=${1:-} input=${2:-}
    shift $(($# < 2 ? $# : 2))
    WORK=$(mktemp -d)
    trap 'down; rm -rf "$WORK"' EXIT
    if [ -z "$model" ]; then
        cache=${TIERFLOW_CACHE:-$HOME/.cache/tierflow}/demo
        python -c 'from tierflow.zoo.digits import build_demo_model; build_demo_model()'
        model=$cache/model.onnx input=$cache/heldout.npz
    fi
    tierflow plan "$model" -o "$WORK/plan" --link device-edge=20mbit,10ms \
        --link edge-cloud=200mbit,20ms \
        --slowdown device=$DEVICE_SLOWDOWN --slowdown edge=$EDGE_SLOWDOWN "$@"
    # Plaintext on the namespaces' private addresses (--insecure); see netns-link.md for TLS.
    ip netns exec $CLOUD tierflow serve cloud --plan "$WORK/plan" --listen 10.77.2.2:50052 \
        --insecure &
    ip netns exec $EDGE tierflow serve edge --plan "$WORK/plan" --listen 10.77.1.2:50051 \
        --upstream 10.77.2.2:50052 --insecure --slowdown $EDGE_SLOWDOWN &
    wait_for 10.77.1.2 50051
    # No --link-emulation: the kernel shapes these links.
    ip netns exec $DEVICE tierflow run --plan "$WORK/plan" --edge 10.77.1.2:50051 \
        --slowdown $DEVICE_SLOWDOWN --input "$input" --output "$WORK/out.npz" \
        --report "$WORK/report.jsonl"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) down ;;
    set) shape "$2" "$3" "$4" change ;;
    replay) replay "$2" "$3" ;;
    run)
        shift
        if ip netns list | grep -q "^$DEVICE\b"; then
            echo "the namespaces are up already: 'run' makes its own (20mbit 10ms, 200mbit 20ms)" \
                "and removes them; run 'down' first, or serve by hand (netns-link.md)" >&2
            exit 2
        fi
        up
        run "$@"
        ;;
    *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
