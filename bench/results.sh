#!/usr/bin/env bash
# Rebuilds bench/results/*.json and bench/results/*.png, the numbers in bench/RESULTS.md.
# Usage: bash bench/results.sh [sim|cpu|tenants|tenants-sim|prefix|all]   (run from the repository root, after `make setup`)
set -euo pipefail
cd "$(dirname "$0")/.."
G=.venv/bin/gapless
OUT=bench/results
mkdir -p "$OUT"
what=${1:-all}

sim_run() {  # profile overlap-flag workload num-requests
  local profile=$1 flag=$2 wl=$3 n=$4 tag
  tag="sim-${profile}-$([ -z "$flag" ] && echo overlap || echo no-overlap)-${wl//:/x}"
  $G bench --launch --workload "$wl" --num-requests "$n" --no-progress \
    --output-json "$OUT/$tag.json" -- --device sim --sim-profile "$profile" \
    --max-num-seqs 256 --max-num-batched-tokens 8192 $flag
}

if [ "$what" = sim ] || [ "$what" = all ]; then
  for profile in a100-llama-1.3b h100-llama3-8b; do
    for flag in "" --no-overlap; do
      sim_run "$profile" "$flag" 1024:64 300
      sim_run "$profile" "$flag" 1024:1024 100
      sim_run "$profile" "$flag" sharegpt 300
      sim_run "$profile" "$flag" loogle 100
    done
  done
fi

if [ "$what" = cpu ] || [ "$what" = all ]; then
  for wl in 1024:64 1024:1024 sharegpt loogle; do
    n=16; [ "$wl" = 1024:1024 ] && n=4; [ "$wl" = loogle ] && n=4
    $G bench --launch --workload "$wl" --num-requests "$n" --no-progress \
      --output-json "$OUT/cpu-${wl//:/x}.json" -- --max-num-batched-tokens 2048
  done
fi

tenants_run() {  # device policy name spec [serve args...]: one multi-tenant run
  local device=$1 policy=$2 name=$3 spec=$4
  shift 4
  $G bench --launch --tenants "$spec" --no-progress \
    --output-json "$OUT/tenants-$device-$policy-$name.json" \
    -- --device "$device" --scheduling-policy "$policy" "$@"
  .venv/bin/bench plot --from "$OUT/tenants-$device-$policy-$name.json" \
    --plot-dir "$OUT/tenants/$device-$policy-$name"
  find "$OUT/tenants/$device-$policy-$name" -name '*.png' ! -name 'tenants_*' -delete
}
EQUAL="T1:n=200,in=128,out=128;T2:n=200,in=128,out=128,start=1"
EQUAL="$EQUAL;T3:n=200,in=128,out=128,start=2;T4:n=200,in=128,out=128,start=3"
WEIGHTED="H:n=400,in=128,out=64-192,weight=2;L:n=400,in=128,out=64-192"
RETURNING="S:n=800,in=128,out=256;R:n=200,in=128,out=256,again=23"
ALONE="A:n=300,in=128,out=16-256"
BACKLOG="Bt:n=200,in=128,out=256,priority=batch;V:n=5,in=128,out=16,start=1,rate=4,priority=interactive"
IDLE="V:n=5,in=128,out=16,rate=4,priority=interactive"

if [ "$what" = tenants ] || [ "$what" = tenants-sim ] || [ "$what" = all ]; then
  for policy in fcfs fair; do
    tenants_run sim "$policy" noisy-neighbor noisy-neighbor
    tenants_run sim "$policy" equal "$EQUAL"
    tenants_run sim "$policy" weighted "$WEIGHTED" --tenant-weight H=2
    tenants_run sim "$policy" returning "$RETURNING"
    tenants_run sim "$policy" alone "$ALONE"
    tenants_run sim "$policy" priority "$BACKLOG"
  done
  tenants_run sim fair priority-idle "$IDLE"
fi

if [ "$what" = tenants ] || [ "$what" = all ]; then
  for policy in fcfs fair; do
    tenants_run cpu "$policy" noisy-neighbor noisy-neighbor --max-num-batched-tokens 2048
  done
fi

cache_run() {  # device on|off workload n [serve args...]: one run, prefix caching on or off
  local device=$1 state=$2 wl=$3 n=$4 tag flag=""
  shift 4
  tag="$device-${wl//:/_}-$state"
  [ "$state" = off ] && flag=--no-prefix-caching
  $G bench --launch --workload "$wl" --num-requests "$n" --no-progress \
    --output-json "$OUT/prefix/$tag.json" -- --device "$device" $flag "$@"
}
SIM_ARGS="--sim-profile h100-llama3-8b --max-num-seqs 256 --max-num-batched-tokens 8192"

if [ "$what" = prefix ] || [ "$what" = all ]; then
  mkdir -p "$OUT/prefix"
  for state in off on; do
    cache_run sim "$state" prefix:1024:32-128:64 300 $SIM_ARGS
    cache_run sim "$state" chat:64:4:128:64:0.5 1 $SIM_ARGS
    cache_run sim "$state" 1024:64 300 $SIM_ARGS  # distinct prompts: 0% hits, the overhead
    cache_run cpu "$state" prefix:1024:16-64:16 16 --max-num-batched-tokens 2048
    cache_run cpu "$state" chat:4:4:64:32:0.5 1 --max-num-batched-tokens 2048
  done
  # the 1,024-token check: the second request shares the first's prefix
  $G bench --launch --workload prefix:1024:16:16 --num-requests 2 --max-concurrency 1 \
    --no-progress --output-json "$OUT/prefix/cpu-ttft-2x1024.json" -- --max-num-batched-tokens 2048
  .venv/bin/python -m gapless.bench.cache_report "$OUT"/prefix/*-on.json "$OUT"/prefix/*-off.json \
    --plot "$OUT/prefix/prefix_cache.png"
fi

.venv/bin/bench plot --from "$OUT"/sim-*.json --plot-dir "$OUT/sim" || true
.venv/bin/bench plot --from "$OUT"/cpu-*.json --plot-dir "$OUT/cpu" || true
