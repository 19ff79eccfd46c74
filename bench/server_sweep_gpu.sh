#!/usr/bin/env bash
# Device call (H200, <= 9 minutes): the server at saturation against the offline engine, and against
# vLLM 0.26's OpenAI server, Qwen3-8B dummy weights, 512 in / 256 out, all in one call:
#   1. `overnight bench throughput --workload seed-512-256` (the offline engine on the same lengths)
#   2. our sweep through our own server (engine in its own process), levels 1 .. 1024, every level
#      measured in its steady state
#   3. if $HOME/vsite holds the unpacked vLLM (.peer/c2/side_by_side.sh unpacks it there): vLLM's
#      OpenAI server on the config folder plus a synthetic tokenizer of Qwen3's 151,936 ids, dummy
#      weights, and the same sweep (same token ids: --vocab-size 151936, same seed) through --url
#   4. a summary: the table, the must-show checks, one JSON line (last)
# Run from the repository root: `bash bench/server_sweep_gpu.sh` (OUT defaults to /tmp/out). Server
# wheels (fastapi, uvicorn, starlette, pydantic, httpx, ...) in .whl/ are installed as in gpu_round3.sh.
# The synthetic tokenizer comes from overnight/tokenizer/synthetic.py (another branch): without it vLLM
# is skipped with a message, our parts still run.
set -u
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
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
# formed, never dissolves (round 10: 1,024 clients ran as one band; overnight/bench/load.py). OUTPUT_RANGE=0
# for equal lengths.
SWEEP_ARGS=${SWEEP_ARGS:-"--input-len 512 --output-len 256 --output-len-range ${OUTPUT_RANGE:-0.25} --seed 0 --window-s 6 --all-levels"}
SWEEP_ARGS="$SWEEP_ARGS --vocab-size $VOCAB"
OUR_LEVELS=${OUR_LEVELS:-"1 8 64 256 512 1024"}
VLLM_LEVELS=${VLLM_LEVELS:-"64 256 512 1024"}
VLLM_CONFIG=${VLLM_CONFIG:-}  # a folder with config.json; default: Qwen3-8B's
BUDGET_S=${BUDGET_S:-530}  # the vLLM sweep stops by then (the call's limit is 600 s)
# Parts: ONLY=ours (1, 2 and 4) or ONLY=vllm (3 and 4; the summary then reads ours from $OUT if a call
# before this one left it there, e.g. OUT kept under $HOME); OUR_EXTRA: more flags for our sweep
# (e.g. "--stream-interval 4", the server's option).
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
VSITE=${VSITE:-$HOME/vsite}
if [ "$ONLY" = ours ]; then
  echo "vLLM skipped (ONLY=ours)"
elif [ ! -f "$VSITE/a/vllm/_C_stable_libtorch.abi3.so" ]; then
  echo "vLLM skipped: $VSITE does not hold the unpacked vLLM (run .peer/c2/side_by_side.sh in this session first)"
else
  CFG="$OUT/qwen3-8b-vllm"; rm -rf "$CFG"; mkdir -p "$CFG"
  for src in $VLLM_CONFIG .peer/c2/configs/qwen3-8b shared/bench/vllm/configs/qwen3-8b ../shared/bench/vllm/configs/qwen3-8b; do
    [ -f "$src/config.json" ] && { cp "$src/config.json" "$CFG/"; break; }
  done
  [ -f "$CFG/config.json" ] || cp overnight/loader/presets/qwen3-8b.json "$CFG/config.json"  # the same file
  if ! python3 - "$CFG" "$VOCAB" <<'PY'
import sys
try:
    from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
except ImportError as e:
    sys.exit(f"vLLM skipped: no overnight.tokenizer.synthetic ({e}); merge the synthetic-tokenizer branch first")
save_synthetic_tokenizer_folder(sys.argv[1], int(sys.argv[2]))
print("synthetic tokenizer of", sys.argv[2], "ids written to", sys.argv[1])
PY
  then
    echo "(vLLM not run)"
  else
    PORT=18431
    PYTHONPATH=$VSITE/a:$VSITE/b VLLM_USE_FLASHINFER_SAMPLER=0 nohup python3 -m vllm.entrypoints.openai.api_server \
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

# The sweeps may run in separate calls (ONLY=vllm, then ONLY=ours): $OUT is emptied before each call,
# $HOME survives while the machine stays warm, so each keeps a copy there and the summary reads both.
# A ratio of parts from different calls is no claim (the same engine moves between calls): the summary
# then prints none.
EARLIER=""
for part in ours vllm offline.jsonl; do
  if [ -e "$OUT/$part" ]; then rm -rf "$HOME/sweep_keep/$part"; mkdir -p "$HOME/sweep_keep"; cp -r "$OUT/$part" "$HOME/sweep_keep/"
  elif [ -e "$HOME/sweep_keep/$part" ]; then cp -r "$HOME/sweep_keep/$part" "$OUT/" && echo "($part from an earlier call)" && EARLIER="$EARLIER $part"; fi
done
export EARLIER

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
earlier = os.environ.get("EARLIER", "").split()
same_call = not ({"ours", "vllm"} & set(earlier))  # both servers' sweeps from this call
if not same_call:
    print(f"({', '.join(earlier)} from an earlier call: no ours / vLLM ratio)")
print(f"{'clients':>7} | {'ours out tok/s':>14} {'tot/out':>7} {'steady':>6} {'SM MHz':>6} | {'vLLM out tok/s':>14} {'tot/out':>7} {'steady':>6} {'SM MHz':>6} | ours/vLLM")
for x in sorted(set(o) | set(v)):
    def cells(lv):
        if lv is None:
            return f"{'-':>14} {'-':>7} {'-':>6} {'-':>6}"
        st = lv["steady"]
        return f"{lv['output_tok_s']:>14.0f} {st['total_per_output']!s:>7} {'yes' if st['steady'] else 'NO':>6} {lv['gpu']['sm_clock_mhz_median']!s:>6}"
    ratio = f"{o[x]['output_tok_s'] / v[x]['output_tok_s']:.2f}x" if same_call and x in o and x in v and v[x]["output_tok_s"] else "-"
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
    "ours_over_vllm_peak": round(po["output_tok_s"] / pv["output_tok_s"], 3) if same_call and po and pv else None,
}
print()
print(f"offline bench throughput: {off} out tok/s (SM {checks['offline_sm_mhz']} MHz)")
print(f"ours: every level steady: {checks['ours_all_steady']}; peak {checks['ours_peak_tok_s']} at {checks['ours_peak_clients']} clients = {checks['ours_peak_over_offline']} of offline (must be >= 0.90)")
print(f"vLLM: every level steady: {checks['vllm_all_steady']}; peak {checks['vllm_peak_tok_s']} at {checks['vllm_peak_clients']} clients; ours / vLLM peaks = {checks['ours_over_vllm_peak']} (must be >= 1.05)")
print(json.dumps(checks))
PY
echo "total $(( $(date +%s) - T0 )) s"
