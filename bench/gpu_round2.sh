#!/usr/bin/env bash
# Device call: the three workloads again, long-1024-1024 with the FP8 KV cache, FP8 accuracy,
# per-step profiles, kernel variants. Logs under $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
section() { echo; echo "=== $1 ($(date +%T))"; }
tp() {  # workload, label, extra args
  section "throughput $1 $2"
  timeout 200 python -m overnight bench throughput --workload "$1" ${@:3} --json-out "$OUT/throughput.jsonl" \
    > "$OUT/tp_$1_$2.log" 2>&1
  grep -E "^overnight|^transformers|ratio|Error|error" "$OUT/tp_$1_$2.log" | tail -4
}
tp nano-256 bf16
tp seed-512-256 bf16
tp long-1024-1024 bf16
tp long-1024-1024 fp8 --kv-cache-dtype fp8
section "fp8 accuracy"
timeout 150 python bench/fp8_gpu.py > "$OUT/fp8.log" 2>&1; grep -v "^{" "$OUT/fp8.log" | tail -14
section "profile seed-512-256"
timeout 120 python bench/profile_gpu.py --workload seed-512-256 --steps 40 --warmup-steps 40 > "$OUT/prof_seed.log" 2>&1
tail -22 "$OUT/prof_seed.log"
section "kernels"
timeout 100 python bench/kernels_gpu.py > "$OUT/kernels2.log" 2>&1; grep -E "fp8|winners|best|checks" "$OUT/kernels2.log" | tail -24
section "profile nano-256"
timeout 90 python bench/profile_gpu.py --workload nano-256 --steps 100 --warmup-steps 150 > "$OUT/prof_nano.log" 2>&1
tail -22 "$OUT/prof_nano.log"
