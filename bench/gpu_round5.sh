#!/usr/bin/env bash
# Round 5 device call 1 (carry .peer/c1 to stage vLLM's extension for the side-by-side calls that follow):
# an end-to-end smoke of the engine after the assembly rework (bf16 and --quantization fp8, CUDA graphs),
# then the FP8-weights kernels and GEMMs, the attention variants. Logs under $OUT.
#   bash bench/gpu_round5.sh [sections...]   (default: smoke fp8w attn)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .peer/c1 ]; then mkdir -p "$HOME/vkeep" && cp .peer/c1/*.xz "$HOME/vkeep/"; fi
section() { echo; echo "=== $1 ($(date +%T)) $(nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader)"; }
smoke() {  # label, extra args: a small qwen3-0.6b workload through the whole engine
  local label=$1; shift
  timeout 120 python -m overnight bench throughput --model qwen3-0.6b --load-format dummy --num-prompts 128 \
    --input-len 200 600 --output-len 64 128 "$@" > "$OUT/smoke_$label.log" 2>&1
  echo "rc=$? $label"; grep -E '^overnight|Error|error' "$OUT/smoke_$label.log" | tail -3
}
for s in ${@:-smoke fp8w attn}; do
  case $s in
    smoke) section smoke; smoke bf16; smoke fp8 --kv-cache-dtype fp8 --quantization fp8 ;;
    fp8w) section fp8w; timeout 190 python bench/fp8_weights_gpu.py > "$OUT/fp8w.log" 2>&1; echo "rc=$?"; tail -60 "$OUT/fp8w.log" ;;
    attn) section attn; timeout 190 python bench/attention_gpu.py --budget-s 140 > "$OUT/attn.log" 2>&1; echo "rc=$?"; tail -45 "$OUT/attn.log" ;;
    profile) section profile; timeout 200 python bench/profile_gpu.py --workload seed-512-256 --quantization fp8 \
        --warmup-steps 60 --steps 30 > "$OUT/profile_fp8.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/profile_fp8.log" ;;
    moe) section moe; timeout 260 python bench/moe_gpu.py --install > "$OUT/moe.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/moe.log" ;;
  esac
done
