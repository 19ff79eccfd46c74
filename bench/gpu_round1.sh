#!/usr/bin/env bash
# One device call: kernel checks and timings, engine correctness in bf16, the three workloads.
# Usage on the GPU machine: bash bench/gpu_round1.sh   (writes logs under $OUT)
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
section() { echo; echo "=== $1 ($(date +%T))"; }
section smoke
timeout 120 python - <<'PY' 2>&1 | tail -15
import time, torch
from overnight import LLM, SamplingParams
t = time.time()
llm = LLM("qwen3-0.6b", load_format="dummy", gpu_memory_utilization=0.3, max_model_len=2048)
print("init", round(time.time() - t, 1), "s")
outs = llm.generate([[1000 + i] * (10 + i) for i in range(40)], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
print("smoke ok", [len(o.outputs[0].token_ids) for o in outs][:5], "steps", llm.engine.num_steps)
PY
section kernels
timeout 200 python bench/kernels_gpu.py > "$OUT/kernels.log" 2>&1; tail -45 "$OUT/kernels.log"
section small_ops
timeout 100 python bench/small_ops_gpu.py > "$OUT/small_ops.log" 2>&1; tail -25 "$OUT/small_ops.log"
section correctness
timeout 150 python bench/correctness_gpu.py 2>&1 | grep -v Warning | tail -6
for w in nano-256 seed-512-256 long-1024-1024; do
  section "throughput $w"
  extra=""
  [ "$w" = seed-512-256 ] && extra="--compare transformers --hf-max-requests 256"
  timeout 240 python -m overnight bench throughput --workload $w $extra --json-out "$OUT/throughput.jsonl" > "$OUT/tp_$w.log" 2>&1
  grep -v "^{" "$OUT/tp_$w.log" | tail -12
done
