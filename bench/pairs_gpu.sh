#!/bin/bash
# On the GPU machine: vLLM 0.26 (unpacked by ../shared/bench/vllm's side_by_side.sh into $HOME/vsite) and
# overnight on the same preset and workload, one after the other in one call (docs/performance.md).
#   bash bench/pairs_gpu.sh PRESET:WORKLOAD[,WORKLOAD...][:fp8] ...   e.g. gemma-3-27b:seed-512-256 gpt-oss-20b:long-1024-1024
#   (several workloads of one preset: vLLM starts once and runs each, ours runs each in turn; then both
#    engines' lines of a workload sit in one call, vLLM's before ours)
#   (image workloads too: qwen2.5-vl-7b:caption-448 qwen3-vl-8b:caption-448; both JSON lines carry images_s)
# Env: OV_ARGS (extra flags for ours), OV_W4A16_TIERS (ours with the W4A16 tiers in that file, bench/w4a16_tiers_gpu.py --save), OV_PATH (more PYTHONPATH for ours, e.g. $HOME/vsite/b for compressed-tensors), VB_ARGS (extra flags for bench/vllm_throughput.py), ONLY_OURS=1, ONLY_VLLM=1,
#      PAIR_TIMEOUT (seconds per engine run, default 240; vLLM's run of several workloads gets it per workload). One line per engine and workload goes to stdout and $OUT/pairs.log.
# vLLM's whole log lands in $OUT/vllm-PRESET-KV.log, and each Triton compile it reported while serving is listed
# beside its JSON lines (their "timed" span tells whether the timed run paid for it).
export PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/pairs.log
site=$HOME/vsite
# vLLM's MoE kernels (part three, copied to $HOME/vkeep by an earlier call): unpacked once, as side_by_side.sh does
[ -f $HOME/vkeep/moe.so.xz ] && [ -d $site/a/vllm ] && [ ! -f $site/a/vllm/_moe_C_stable_libtorch.abi3.so ] && \
  xz -T0 -dc $HOME/vkeep/moe.so.xz > $site/a/vllm/_moe_C_stable_libtorch.abi3.so
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$log"
for spec in "$@"; do
  IFS=: read -r preset workloads kv <<< "$spec"; kv=${kv:-auto}
  tag="$preset $workloads kv=$kv"
  n=$(( $(tr -cd , <<< "$workloads" | wc -c) + 1 ))
  if [ -z "${ONLY_OURS:-}" ]; then
    PYTHONPATH=$site/a:$site/b:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 timeout $(( ${PAIR_TIMEOUT:-240} * n )) python3 bench/vllm_throughput.py \
      --model "$preset" --workload "$workloads" --kv-cache-dtype "$kv" ${VB_ARGS:-} > /tmp/v.log 2>&1
    rc=$?; echo "== vllm rc=$rc $tag ${VB_ARGS:-}" | tee -a "$log"
    cp /tmp/v.log "${OUT:-/tmp}/vllm-${preset}-${kv}.log"  # its whole log comes back with the results
    # Triton compiles vLLM reported while serving (warm-up or timed run: compare with the line's "timed")
    # the kernels vLLM chose for quantized layers (on Hopper its AWQ "Marlin" method runs Machete)
    { grep '^{' /tmp/v.log || true; grep -E 'GPU KV cache size|Maximum concurrency' /tmp/v.log | tail -2 || true
      grep -oE 'Using [A-Za-z]+LinearKernel for [A-Za-z]+|Using .[A-Z_]+. [A-Za-z0-9]+ MoE backend' /tmp/v.log | sort -u | sed 's/^/vllm kernel: /' || true
      grep 'JIT compilation during inference' /tmp/v.log | sed -E 's/.*([0-9]{2}-[0-9]{2} [0-9:]{8}).*inference: ([^.]*).*/vllm jit compile at \1: \2/' || true
      [ $rc -ne 0 ] && grep -v '^\(INFO\|DEBUG\)' /tmp/v.log | tail -12; } | tee -a "$log"
  fi
  [ -n "${ONLY_VLLM:-}" ] && continue
  for workload in ${workloads//,/ }; do
    # OV_W4A16_TIERS (a file bench/w4a16_tiers_gpu.py wrote): ours with those W4A16 tiers, through its --apply
    ov=(-m overnight); [ -n "${OV_W4A16_TIERS:-}" ] && ov=(bench/w4a16_tiers_gpu.py --apply "$(cat "$OV_W4A16_TIERS")" --)
    PYTHONPATH=$PWD${OV_PATH:+:$OV_PATH} timeout "${PAIR_TIMEOUT:-240}" python3 "${ov[@]}" bench throughput --model "$preset" --workload "$workload" \
      --load-format dummy --kv-cache-dtype "$kv" ${OV_ARGS:-} > /tmp/o.log 2>&1
    rc=$?; echo "== ours rc=$rc $preset $workload kv=$kv ${OV_ARGS:-}" | tee -a "$log"
    { grep '^{' /tmp/o.log | tail -1 || true; [ $rc -ne 0 ] && tail -12 /tmp/o.log; } | tee -a "$log"
  done
done
