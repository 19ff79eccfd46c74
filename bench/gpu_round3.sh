#!/usr/bin/env bash
# Device call: final throughput of the three workloads, long-1024-1024 with FP8 KV, the concurrency
# sweep through the server (Qwen3-8B dummy, 512 in / 256 out), and two limit settings for a batch job.
# A machine without the server packages (fastapi, uvicorn, starlette, pydantic, opentelemetry-api) and
# without network gets them as wheels in .whl/. Logs and the sweep's JSON/PNG under $OUT.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
section() { echo; echo "=== $1 ($(date +%T))"; }
tp() {  # workload, label, extra args
  section "throughput $1 $2"
  timeout 170 python -m overnight bench throughput --workload "$1" ${@:3} --json-out "$OUT/throughput.jsonl" \
    > "$OUT/tp_$1_$2.log" 2>&1
  grep -E "^overnight|Error|error" "$OUT/tp_$1_$2.log" | tail -3
}
tp nano-256 bf16
tp seed-512-256 bf16
tp long-1024-1024 bf16
tp long-1024-1024 fp8 --kv-cache-dtype fp8
section "sweep"
timeout 200 python -m overnight bench sweep --model qwen3-8b --load-format dummy --input-len 512 --output-len 256 \
  --levels 1 8 64 256 1024 --warmup-s 8 --window-s 8 --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1
tail -25 "$OUT/sweep.log"
tp seed-512-256 bt32k --max-num-batched-tokens 32768
tp seed-512-256 seqs512 --max-num-seqs 512
