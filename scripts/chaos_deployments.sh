#!/usr/bin/env bash
# The reliability suite (scripts/chaos.py) against the three scale-out deployments on this machine, each on the
# embedded default model: tensor parallelism 2 (fuzz, soak, an agent rank SIGKILLed and SIGSTOPped), data
# parallelism (a router over 2 engines: fuzz, soak, then a soak during which one engine is SIGKILLed) and
# prefill/decode disaggregation (a router, a prefill engine, a decode engine trusting it: fuzz, soak, the decode
# engine's KV fetches by how). Figures and logs under OUTDIR (docs/reliability.md, "Scale-out").
#   bash scripts/chaos_deployments.sh OUTDIR [SOAK_SECONDS]
set -u
OUT=${1:?usage: chaos_deployments.sh OUTDIR [SOAK_SECONDS]}; SOAK=${2:-60}
mkdir -p "$OUT"; cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
URL=http://127.0.0.1
wait_ready() { for _ in $(seq 1 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; echo "not ready: $1"; exit 1; }
chaos() { # name url sections [args...]
  local name=$1 url=$2 sections=$3; shift 3
  $PY scripts/chaos.py --url "$url" --sections "$sections" --soak-seconds "$SOAK" --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.txt" 2>&1
  echo "$name: exit $? ($(date -u +%FT%TZ))"
}
stop() { kill -INT "$@" 2>/dev/null; wait "$@" 2>/dev/null; }
tracebacks() { for f in "$@"; do echo "$(basename "$f"): $(grep -c Traceback "$f")"; done; }

echo "TP 2 from $(date -u +%FT%TZ)"
$PY -m llm_serving serve --port 18101 --agents 2 >"$OUT/tp2.log" 2>&1 & TP=$!
wait_ready $URL:18101
chaos tp2 $URL:18101 fuzz,soak,sigkill,sigstop
stop $TP; tracebacks "$OUT/tp2.log"

echo "DP from $(date -u +%FT%TZ)"
$PY -m llm_serving serve --port 18111 >"$OUT/dp-a.log" 2>&1 & A=$!
$PY -m llm_serving serve --port 18112 >"$OUT/dp-b.log" 2>&1 & B=$!
wait_ready $URL:18111; wait_ready $URL:18112
$PY -m llm_serving router --engine $URL:18111 --engine $URL:18112 --port 18110 >"$OUT/dp-router.log" 2>&1 & R=$!
wait_ready $URL:18110
chaos dp $URL:18110 fuzz,soak
(sleep 10; kill -KILL $B) & chaos dp-engine-killed $URL:18110 soak --soak-seconds 30
stop $R $A; tracebacks "$OUT/dp-a.log" "$OUT/dp-router.log"

echo "PD from $(date -u +%FT%TZ)"
$PY -m llm_serving serve --port 18121 --set serving_config.kv_transfer=true >"$OUT/pd-prefill.log" 2>&1 & PF=$!
$PY -m llm_serving serve --port 18122 --set serving_config.kv_transfer=true \
  --set "serving_config.kv_transfer_peers=[\"$URL:18121\"]" >"$OUT/pd-decode.log" 2>&1 & DC=$!
wait_ready $URL:18121; wait_ready $URL:18122
$PY -m llm_serving router --engine $URL:18122 --prefill $URL:18121 --port 18120 >"$OUT/pd-router.log" 2>&1 & R=$!
wait_ready $URL:18120
chaos pd $URL:18120 fuzz,soak
curl -s $URL:18122/metrics | grep '^llm_serving_kv_transfer_fetches_total' | tee "$OUT/pd-fetches.txt"
stop $R $PF $DC; tracebacks "$OUT"/pd-*.log
