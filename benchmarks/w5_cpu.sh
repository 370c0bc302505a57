#!/usr/bin/env bash
# W5 (online mixed lanes) on this CPU with the default model: start `rtx serve` with the sla-lanes scheduler and
# benchmarks/w5_cpu.toml, measure capacity with `rtx loadgen`, then run W5 at 1.5x capacity (Poisson) and the spiky
# pattern (3x capacity for 10 s every 60 s over a base of 0.5x). Reports (tables and JSON) go to $OUT (./w5-out).
# Usage: benchmarks/w5_cpu.sh [SECONDS_AT_1.5x] [SECONDS_SPIKY]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/w5-out}
mkdir -p "$OUT"
RTX=${RTX:-.venv/bin/rtx}
PORT=${PORT:-8311}
URL=http://127.0.0.1:$PORT
lengths=(--prompt-tokens realtime=16:32 --prompt-tokens standard=32:96 --prompt-tokens bulk=96:192
         --output-tokens realtime=8:16 --output-tokens standard=16:32 --output-tokens bulk=32:64)

$RTX serve --port "$PORT" --no-grpc --scheduler sla-lanes --config benchmarks/w5_cpu.toml --max-num-seqs 16 \
  --max-num-batched-tokens 256 >"$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until curl -sf "$URL/ready" >/dev/null; do sleep 1; kill -0 $server || { cat "$OUT/server.log"; exit 1; }; done

$RTX loadgen --url "$URL" --load 1.5 --capacity-clients 16 --capacity-duration 40 --duration "${1:-120}" \
  "${lengths[@]}" --seed 1 --json "$OUT/w5_poisson_1.5x.json" | tee "$OUT/w5_poisson_1.5x.txt"
capacity=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['capacity_rps'])" "$OUT/w5_poisson_1.5x.json")
sleep 20  # let the backlog drain and brownout settle before the next pattern
$RTX loadgen --url "$URL" --capacity "$capacity" --load 0.5 --pattern spiky --spike-factor 6 --spike-len 10 \
  --spike-period 60 --spike-start 10 --duration "${2:-130}" "${lengths[@]}" --seed 2 \
  --json "$OUT/w5_spiky.json" | tee "$OUT/w5_spiky.txt"
sleep 15
grep "rtx.brownout" "$OUT/server.log" | tee "$OUT/brownout.log" || true
