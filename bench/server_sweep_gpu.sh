#!/usr/bin/env bash
# The server at saturation against the offline engine and against vLLM's OpenAI server, on one GPU in
# one run (H200: about 9 minutes), Qwen3-8B dummy weights, 512 tokens in / 256 +- 25% out:
#   1. `overnight bench throughput --workload seed-512-256` (the offline engine on the same lengths)
#   2. our sweep through our own server (engine in its own process), every level measured in its
#      steady state (overnight/bench/steady.py)
#   3. when vLLM is installed: vLLM's OpenAI server on the preset's config.json plus a synthetic tokenizer
#      of Qwen3's 151,936 ids (overnight/tokenizer/synthetic.py), dummy weights, and the same sweep (the
#      same token ids: --vocab-size 151936, the same seed) through --url
#   4. a summary: the table, the peaks, one JSON line (last)
# Run from the repository root: `bash bench/server_sweep_gpu.sh` (OUT defaults to /tmp/out). Needs the
# server and bench extras (pip install -e '.[server,bench]').
set -u
export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
section() { echo; echo "=== $1 ($(date +%T), $(( $(date +%s) - T0 )) s in)"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader

# (Each setting can be overridden from the environment, for a dry run on a small model.)
OFFLINE_ARGS=${OFFLINE_ARGS:-"--workload seed-512-256"}
MODEL_ARGS=${MODEL_ARGS:-"--model qwen3-8b --load-format dummy --max-model-len 4096"}
VOCAB=${VOCAB:-151936}
# Same levels and lengths for both servers. Windows of two request lifetimes (steady.py); at 1024
# clients a request lives ~27 s, so that level alone takes ~70 s.
# Answers of 256 +- 25% tokens (mean 256): with all answers of one length a band of clients, once
# formed, never dissolves (overnight/bench/load.py). OUTPUT_RANGE=0 for equal lengths.
SWEEP_ARGS=${SWEEP_ARGS:-"--input-len 512 --output-len 256 --output-len-range ${OUTPUT_RANGE:-0.25} --seed 0 --window-s 6 --all-levels"}
SWEEP_ARGS="$SWEEP_ARGS --vocab-size $VOCAB"
# Start at 64 clients or below: a sweep that starts higher ramps on one lone request's life and then
# measures its first level twice.
OUR_LEVELS=${OUR_LEVELS:-"64 512 1024"}
VLLM_LEVELS=${VLLM_LEVELS:-"64 512 1024"}
VLLM_CONFIG=${VLLM_CONFIG:-}  # a config.json for vLLM; default: the qwen3-8b preset's
BUDGET_S=${BUDGET_S:-900}  # seconds from the start by which the vLLM sweep is stopped
# Parts: ONLY=ours (1, 2 and 4) or ONLY=vllm (3 and 4); OUR_EXTRA: more flags for our sweep (e.g.
# "--stream-interval 4", the server's option).
ONLY=${ONLY:-}
OUR_EXTRA=${OUR_EXTRA:-}

if [ "$ONLY" != vllm ]; then
section "1. offline: bench throughput seed-512-256"
timeout ${OFFLINE_TIMEOUT:-150} python3 -m overnight bench throughput $OFFLINE_ARGS --json-out "$OUT/offline.jsonl" \
  > "$OUT/offline.log" 2>&1
echo "rc=$?"; grep -E "^overnight|Error" "$OUT/offline.log" | tail -3

section "2. our server: sweep $OUR_LEVELS $OUR_EXTRA"
timeout -k 75 ${OURS_TIMEOUT:-240} python3 -m overnight bench sweep $MODEL_ARGS $SWEEP_ARGS $OUR_EXTRA --levels $OUR_LEVELS \
  --out "$OUT/ours" > "$OUT/ours.log" 2>&1
echo "rc=$?"; tail -14 "$OUT/ours.log"
fi

section "3. vLLM's server: sweep $VLLM_LEVELS"
if [ "$ONLY" = ours ]; then
  echo "vLLM skipped (ONLY=ours)"
elif ! python3 -c "import vllm" 2>/dev/null; then
  echo "vLLM skipped: not installed"
else
  CFG="$OUT/qwen3-8b-vllm"; rm -rf "$CFG"; mkdir -p "$CFG"
  cp "${VLLM_CONFIG:-overnight/loader/presets/qwen3-8b.json}" "$CFG/config.json"
  if ! python3 - "$CFG" "$VOCAB" <<'PY'
import sys
try:
    from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
except ImportError as e:
    sys.exit(f"vLLM skipped: {e}")
save_synthetic_tokenizer_folder(sys.argv[1], int(sys.argv[2]))
print("synthetic tokenizer of", sys.argv[2], "ids written to", sys.argv[1])
PY
  then
    echo "(vLLM not run)"
  else
    PORT=18431
    nohup python3 -m vllm.entrypoints.openai.api_server \
      --model "$CFG" --load-format dummy --dtype bfloat16 --max-model-len 4096 --seed 0 \
      --host 127.0.0.1 --port $PORT > "$OUT/vllm_server.log" 2>&1 &
    VPID=$!; VSTART=$(date +%s)
    up=0
    for i in $(seq 1 150); do  # start-up: ~65 s for LLM(); compile and graphs
      if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
        up=1; break
      fi
      kill -0 $VPID 2>/dev/null || break
      sleep 2
    done
    if [ $up = 1 ]; then
      echo "vLLM up after $(( $(date +%s) - VSTART )) s"
      left=$(( BUDGET_S - ($(date +%s) - T0) ))
      timeout -k 20 $(( left > 30 ? left : 30 )) python3 -m overnight bench sweep --url "http://127.0.0.1:$PORT" \
        $SWEEP_ARGS --levels $VLLM_LEVELS --out "$OUT/vllm" > "$OUT/vllm.log" 2>&1
      echo "rc=$?"; tail -12 "$OUT/vllm.log"
    else
      echo "vLLM's server did not come up:"; tail -25 "$OUT/vllm_server.log"
    fi
    kill $VPID 2>/dev/null  # SIGTERM: vLLM stops its engine process itself
    for i in $(seq 1 15); do kill -0 $VPID 2>/dev/null || break; sleep 1; done
    pkill -9 -P $VPID 2>/dev/null; kill -9 $VPID 2>/dev/null  # by id: its children, then it
  fi
fi

section "4. summary"
python3 - "$OUT" <<'PY'
import json, os, sys

out = sys.argv[1]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


offline = None
try:
    with open(os.path.join(out, "offline.jsonl")) as f:
        offline = json.loads(f.read().strip().splitlines()[-1])["results"][0]
except (OSError, ValueError, IndexError, KeyError):
    pass
ours, vllm = load(os.path.join(out, "ours", "sweep.json")), load(os.path.join(out, "vllm", "sweep.json"))


def by_level(doc):
    return {int(lv["x"]): lv for lv in doc["levels"]} if doc else {}


o, v = by_level(ours), by_level(vllm)
print(f"{'clients':>7} | {'ours out tok/s':>14} {'tot/out':>7} {'steady':>6} {'SM MHz':>6} | {'vLLM out tok/s':>14} {'tot/out':>7} {'steady':>6} {'SM MHz':>6} | ours/vLLM")
for x in sorted(set(o) | set(v)):
    def cells(lv):
        if lv is None:
            return f"{'-':>14} {'-':>7} {'-':>6} {'-':>6}"
        st = lv["steady"]
        return f"{lv['output_tok_s']:>14.0f} {st['total_per_output']!s:>7} {'yes' if st['steady'] else 'NO':>6} {lv['gpu']['sm_clock_mhz_median']!s:>6}"
    ratio = f"{o[x]['output_tok_s'] / v[x]['output_tok_s']:.2f}x" if x in o and x in v and v[x]["output_tok_s"] else "-"
    print(f"{x:>7} | {cells(o.get(x))} | {cells(v.get(x))} | {ratio}")


def peak(levels):
    steady = [lv for lv in levels.values() if lv["steady"]["steady"]]
    return max(steady, key=lambda lv: lv["output_tok_s"]) if steady else None


po, pv = peak(o), peak(v)
off = offline["output_tok_s"] if offline else None
checks = {
    "offline_tok_s": off,
    "offline_sm_mhz": offline["clocks"].get("sm_clock_mhz_median") if offline else None,
    "ours_levels": sorted(o),
    "ours_all_steady": bool(o) and all(lv["steady"]["steady"] for lv in o.values()),
    "ours_peak_tok_s": po["output_tok_s"] if po else None,
    "ours_peak_clients": int(po["x"]) if po else None,
    "ours_peak_over_offline": round(po["output_tok_s"] / off, 3) if po and off else None,
    "vllm_levels": sorted(v),
    "vllm_all_steady": bool(v) and all(lv["steady"]["steady"] for lv in v.values()),
    "vllm_peak_tok_s": pv["output_tok_s"] if pv else None,
    "vllm_peak_clients": int(pv["x"]) if pv else None,
    "ours_over_vllm_peak": round(po["output_tok_s"] / pv["output_tok_s"], 3) if po and pv else None,
}
print()
print(f"offline bench throughput: {off} out tok/s (SM {checks['offline_sm_mhz']} MHz)")
print(f"ours: every level steady: {checks['ours_all_steady']}; peak {checks['ours_peak_tok_s']} at {checks['ours_peak_clients']} clients = {checks['ours_peak_over_offline']} of offline")
print(f"vLLM: every level steady: {checks['vllm_all_steady']}; peak {checks['vllm_peak_tok_s']} at {checks['vllm_peak_clients']} clients; ours / vLLM peaks = {checks['ours_over_vllm_peak']}")
print(json.dumps(checks))
PY
echo "total $(( $(date +%s) - T0 )) s"
