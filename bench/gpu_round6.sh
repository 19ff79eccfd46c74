#!/usr/bin/env bash
# Round 6: the must-show runs of issues 15, 17, 18, 19 and 21 in four device calls back to back (the
# machine stays warm 30 s between calls; files under $HOME survive that). vLLM's parts come from
# ../shared/bench/vllm/build.sh (in .peer/); each call names what it carries:
#
#   1. carry .peer/c1:  bash bench/gpu_round6.sh moe batch        (stage vLLM part 1; MoE check + tile
#                       tuning, kept in $HOME for call 3; run-batch look-ahead against file order)
#   2. carry .peer/c3:  bash bench/gpu_round6.sh                  (stage vLLM's MoE extension)
#   3. carry .peer/c2:  bash bench/gpu_round6.sh moe-side         (unpack vLLM; Qwen3-30B-A3B side by
#                       side on seed-512-256 and long-1024-1024; the MoE step profile if time is left)
#   4. carry .whl:      bash bench/gpu_round6.sh embed structured attn   (vLLM from $HOME/vsite)
#
# Next (not run yet): after `unpack`, `bash bench/gpu_round6.sh profile-pair` profiles the whole of
# long-1024-1024 with an FP8 cache in vLLM and in ours (WORKLOAD / KV / QUANT override), one after the other
# (issue 15); `moe-fp8` tunes the FP8 experts' tiles and `moe-side-fp8` (c1, c3 staged, c2 carried) runs
# Qwen3-30B-A3B with FP8 weights on both engines.
#
# Round 7 ran `profile-pair`'s two halves (docs/benchmarks.md "Round 7"). Next (issues 14, 15, 16), with
# c1 staged and c2 carried: `side-bf16` (seed-512-256 and long-1024-1024 with bf16 weights and cache, the
# "not slower" check), `profile-ours` (the whole run of long-1024-1024 with FP8 weights and cache after the
# compile fix: what idles now), `kv-access` (bench/kv_access_gpu.py: do 128-byte runs cap FP8 reads?),
# `attn` (the 256-token FP8 tiles); then, carrying .whl, `sweep` (the
# server sweep of bench/server_sweep_gpu.sh, ~9 minutes alone).
#
# Round 8 ran kv-access, attn, one long-1024-1024 FP8 pair and three server sweeps (docs/benchmarks.md
# "Round 8"). Next, in this order, each call right after the one before (the machine stays warm 30 s):
#   1. carry .peer/c1:  bash bench/gpu_round6.sh                       (stage vLLM part 1)
#   2. carry .peer/c2:  bash bench/gpu_round6.sh side-fp8kv side-seed  (issue 15: long-1024-1024 with an
#                       FP8 cache and bf16 weights; seed-512-256 bf16, the "not slower" check; ~460 s)
#   3. carry .peer/c2:  bash bench/gpu_round6.sh side-long             (long-1024-1024 bf16; ~240 s)
#   4. carry .whl:      bash bench/gpu_round6.sh sweep-vllm            (issue 16: vLLM's server at 256, 512
#                       and 1,024 clients, from $HOME/vsite; ~420 s, its start-up alone ~160 s)
#   5. carry .whl:      bash bench/gpu_round6.sh sweep-ours            (our offline figure and sweep 1-1,024
#                       in one call; OUR_EXTRA="--stream-interval 4" if 512 is unsteady again; ~300 s)
#
# Round 9 ran side-fp8kv, side-seed, side-long and two of our sweeps (docs/benchmarks.md "Round 9"); two
# calls were lost because the machine went back between calls. The warm window is 30 s from the end of
# one call to the start of the next: send the next call at once, with nothing written in between.
# Next (issues 15 and 16), in this order:
#   1. carry .peer/c1:         bash bench/gpu_round6.sh                       (stage vLLM part 1)
#   2. carry .peer/c2 + .whl:  bash bench/gpu_round6.sh unpack sweep-vllm     (vLLM's server at 256, 512,
#                              1,024 clients; ~560 s; c2 and the wheels fit 64 MiB together, c1 does not)
#   3. carry .whl:             bash bench/gpu_round6.sh sweep-ours            (offline, then our sweep 1-1,024;
#                              the summary reads vLLM's sweep kept in $HOME: ours / vLLM peaks; ~350 s)
#   4. no carry:               bash bench/gpu_round6.sh attn                  (the FP8-cache prefill with
#                              e4m3 dots beside FA3, from $HOME/vsite; ~500 s)
#   5. carry .peer/c2, if 4 shows the e4m3 prefill faster: OV_ARGS="--attention-variant fp8-mma" with
#                              side-fp8kv (long-1024-1024 with an FP8 cache, ~280 s)
#
# Round 10 ran all of that but the fp8-mma side-by-side's condition (it ran anyway, twice) and added a
# profile-pair of long-1024-1024 with an FP8 cache and bf16 weights (docs/benchmarks.md "Round 10").
# FP8 caches now default to the e4m3 dots. Next (issues 15 and 16), in this order:
#   1. carry .peer/c1:         bash bench/gpu_round6.sh                       (stage vLLM part 1)
#   2. carry .peer/c2 + .whl:  bash bench/gpu_round6.sh unpack sweep-pair     (one call: offline, our server
#                              and vLLM's at 512 and 1,024 clients, answers of 256 +- 25% tokens: the
#                              ours / vLLM ratio from one call; ~500 s)
#   3. carry .whl:             bash bench/gpu_round6.sh sweep-ours            (offline, then our sweep 1-1,024
#                              on the same lengths: every level steady?; ~300 s)
#   4. carry .peer/c2:         bash bench/gpu_round6.sh side-fp8kv attn-prefill  (issue 15's FP8-cache pair
#                              with the new default; the prefill checks, RMS against the emulation)
#   5. if time is left, carry .whl: OUTPUT_RANGE=0 OUR_LEVELS="512 1024" bash bench/gpu_round6.sh sweep-ours
#                              (equal lengths again; the timeline now starts at each level's start, so a
#                              band's formation shows)
#
# Round 11 ran pages, fp8acc, side-fp8kv, side-fp8both, sweep-pair, sweep-ours, pages-e5m2 and
# profile-fp8kv (docs/benchmarks.md "Round 11"). Next (issue 16: vLLM's steady peak beside ours):
#   1. carry .peer/c1:         bash bench/gpu_round6.sh                       (stage vLLM part 1)
#   2. carry .peer/c2 + .whl:  bash bench/gpu_round6.sh unpack sweep-pair     (offline, then both servers at
#                              64, 512 and 1,024 clients in one call; ~500 s)
# If time is left: carry .peer/c2, `side-seed` and `side-long` (the bf16 pairs), or nano-256 by
# `bash .peer/c2/side_by_side.sh nano-256`.
#
# Round 12 ran those two calls (both peaks at 512 clients: 1.094x), then both servers at 1,024 clients
# alone (wasted: a sweep that starts at 1,024 ramps on one lone request's life and measures the level
# twice; start at 64) and vLLM alone at 64 / 512 / 1,024 (docs/benchmarks.md "Round 12"). Next, with the
# lease's other time: carry .peer/c2, `side-seed` and `side-long` (the bf16 pairs, last measured in round
# 9), nano-256, and a whole-run `profile-pair` with the FP8 cache's new defaults.
#
# Logs under $OUT; each section prints its summary lines.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
VSITE=$HOME/vsite
VC2=$HOME/vc2  # side_by_side.sh, vllm_bench.py and the config folders, kept for calls without .peer/c2
section() { echo; echo "=== $1 ($(( $(date +%s) - T0 )) s in) $(nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader)"; }

mkdir -p "$HOME/vkeep"
for part in c1 c3; do [ -d .peer/$part ] && cp .peer/$part/*.xz "$HOME/vkeep/" && echo "staged .peer/$part"; done
if [ -d .peer/c2 ]; then rm -rf "$VC2"; mkdir -p "$VC2" && cp -r .peer/c2/side_by_side.sh .peer/c2/vllm_bench.py \
  .peer/c2/workloads.py .peer/c2/configs "$VC2/"; fi
# The MoE tile configs tuned in call 1 (the working tree sent with each call has the committed file).
[ -f "$HOME/moe_configs.json" ] && cp "$HOME/moe_configs.json" overnight/kernels/moe_configs.json \
  && echo "MoE configs from call 1 installed"

for s in "$@"; do
  case $s in
    moe)
      section "moe: check, tune, install (bench/moe_gpu.py)"
      timeout 300 python bench/moe_gpu.py --install > "$OUT/moe.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/moe.log"
      cp overnight/kernels/moe_configs.json "$HOME/moe_configs.json" && cp overnight/kernels/moe_configs.json "$OUT/" ;;
    moe-fp8)
      section "moe-fp8: FP8 experts' tiles (bench/moe_gpu.py --fp8 --install)"
      timeout 300 python bench/moe_gpu.py --fp8 --install --skip-engine > "$OUT/moe_fp8.log" 2>&1; echo "rc=$?"
      tail -24 "$OUT/moe_fp8.log"
      cp overnight/kernels/moe_configs.json "$HOME/moe_configs.json" && cp overnight/kernels/moe_configs.json "$OUT/" ;;
    moe-side-fp8)
      section "moe-side-fp8: Qwen3-30B-A3B with FP8 weights on both (side_by_side.sh)"
      VB_MODEL=qwen3-30b-a3b VB_QUANT=fp8 OV_ARGS="--model qwen3-30b-a3b --quantization fp8" \
        bash .peer/c2/side_by_side.sh seed-512-256 long-1024-1024 ;;
    batch)
      section "batch: run-batch look-ahead against file order (bench/batch_schedule.py --gpu)"
      PYTHONPATH=$VSITE/b:$PWD timeout 330 python bench/batch_schedule.py --gpu --skip-order --fcfs-budget-s 0 --run-limit-s 100 \
        > "$OUT/batch.log" 2>&1; echo "rc=$?"; tail -14 "$OUT/batch.log" ;;
    moe-side)
      section "moe-side: Qwen3-30B-A3B, vLLM and ours (side_by_side.sh)"
      VB_MODEL=qwen3-30b-a3b OV_ARGS="--model qwen3-30b-a3b" bash .peer/c2/side_by_side.sh seed-512-256 long-1024-1024
      ;;
    moe-profile)
      section "moe profile: seed-512-256 decode steps of Qwen3-30B-A3B"
      timeout 200 python bench/profile_gpu.py --model qwen3-30b-a3b \
        --workload seed-512-256 --warmup-steps 60 --steps 30 > "$OUT/profile_moe.log" 2>&1
      echo "rc=$?"; tail -24 "$OUT/profile_moe.log" ;;
    profile-pair)
      w=${WORKLOAD:-long-1024-1024}; kv=${KV:-fp8}; q=${QUANT:+--quantization $QUANT}
      section "profile-pair: $w, KV $kv ${QUANT:-bf16 weights}: vLLM, then ours"
      VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$VSITE/a:$VSITE/b:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 timeout 280 \
        python bench/profile_vllm.py "$VC2/configs" $w --kv-cache-dtype $kv $q > "$OUT/profile_vllm.log" 2>&1
      echo "vllm rc=$?"; grep -A24 "^vLLM: the whole run" "$OUT/profile_vllm.log" || tail -20 "$OUT/profile_vllm.log"
      timeout 250 python bench/profile_gpu.py --workload $w --whole-run --kv-cache-dtype $kv $q \
        > "$OUT/profile_ours.log" 2>&1; echo "ours rc=$?"; tail -26 "$OUT/profile_ours.log" ;;
    side-bf16)
      section "side-bf16: seed-512-256 and long-1024-1024, bf16 weights and cache (side_by_side.sh)"
      bash .peer/c2/side_by_side.sh seed-512-256 long-1024-1024 ;;
    profile-ours)
      section "profile-ours: the whole run of long-1024-1024, FP8 weights and cache"
      timeout 250 python bench/profile_gpu.py --workload long-1024-1024 --whole-run --kv-cache-dtype fp8 \
        --quantization fp8 > "$OUT/profile_ours.log" 2>&1; echo "rc=$?"; tail -30 "$OUT/profile_ours.log" ;;
    kv-access)
      section "kv-access: the KV cache's read rate by page layout, dtype and grid (bench/kv_access_gpu.py)"
      timeout 200 python bench/kv_access_gpu.py > "$OUT/kv_access.log" 2>&1; echo "rc=$?"; tail -36 "$OUT/kv_access.log" ;;
    sweep)
      section "sweep: the server against offline and vLLM's server (bench/server_sweep_gpu.sh)"
      bash bench/server_sweep_gpu.sh ;;
    sweep-ours)
      section "sweep-ours: offline, then our server's sweep 1-1024 (bench/server_sweep_gpu.sh ONLY=ours)"
      ONLY=ours OURS_TIMEOUT=420 bash bench/server_sweep_gpu.sh ;;
    sweep-vllm)
      section "sweep-vllm: vLLM's server at 256-1024 clients (bench/server_sweep_gpu.sh ONLY=vllm)"
      # The sweep's budget counts from its own start: leave out what this call spent before it (unpack).
      ONLY=vllm VLLM_LEVELS="256 512 1024" BUDGET_S=$(( 560 - ($(date +%s) - T0) )) bash bench/server_sweep_gpu.sh ;;
    sweep-pair)
      section "sweep-pair: our server and vLLM's at 64, 512 and 1,024 clients, one call (bench/server_sweep_gpu.sh)"
      # Both servers in one call, so their ratio is one call's; the budget counts from the call's start.
      # Levels from 64: the ramps of 512 and 1,024 then come from the rate measured below them (a sweep
      # that starts at 512 ramps on one lone request's life and measures that level twice: round 11).
      # The offline figure is left out (OFFLINE_TIMEOUT=1): both sweeps need the call's time, and the
      # server / offline ratio comes from sweep-ours (0.934 in round 11).
      OUR_LEVELS="64 512 1024" VLLM_LEVELS="64 512 1024" OFFLINE_TIMEOUT=1 OURS_TIMEOUT=230 \
        BUDGET_S=$(( 570 - ($(date +%s) - T0) )) bash bench/server_sweep_gpu.sh ;;
    side-fp8kv)
      section "side-fp8kv: long-1024-1024, FP8 cache on both, bf16 weights (side_by_side.sh)"
      bash .peer/c2/side_by_side.sh long-1024-1024:fp8 ;;
    side-fp8both)
      section "side-fp8both: long-1024-1024, FP8 weights and FP8 cache on both (side_by_side.sh)"
      VB_QUANT=fp8 OV_ARGS="--quantization fp8 ${OV_ARGS:-}" bash .peer/c2/side_by_side.sh long-1024-1024:fp8 ;;
    fp8acc)
      section "fp8acc: FP8-cache accuracy against a bf16 cache with the engine's defaults (bench/fp8_gpu.py)"
      timeout 300 python bench/fp8_gpu.py > "$OUT/fp8acc.log" 2>&1; echo "rc=$?"; tail -30 "$OUT/fp8acc.log" ;;
    side-seed)
      section "side-seed: seed-512-256, bf16 weights and cache (side_by_side.sh)"
      bash .peer/c2/side_by_side.sh seed-512-256 ;;
    side-long)
      section "side-long: long-1024-1024, bf16 weights and cache (side_by_side.sh)"
      bash .peer/c2/side_by_side.sh long-1024-1024 ;;
    unpack)
      section "unpack vLLM"; ONLY_VLLM=1 bash .peer/c2/side_by_side.sh ;;
    embed)
      section "embed: vLLM's LLM.embed, then ours (bench/embed_vllm.py, bench/embed_gpu.py)"
      PYTHONPATH=$VSITE/a:$VSITE/b:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 timeout 240 python bench/embed_vllm.py \
        "$VC2/configs/qwen3-0.6b" > "$OUT/embed_vllm.log" 2>&1; echo "vllm rc=$?"; tail -8 "$OUT/embed_vllm.log"
      timeout 180 python bench/embed_gpu.py --throughput-only > "$OUT/embed_ours.log" 2>&1
      echo "ours rc=$?"; tail -8 "$OUT/embed_ours.log" ;;
    structured)
      section "structured: constrained against unconstrained (bench/structured_gpu.py)"
      rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
      PYTHONPATH=/tmp/site:$VSITE/b:$PWD timeout 240 python bench/structured_gpu.py > "$OUT/structured.log" 2>&1
      echo "rc=$?"; tail -30 "$OUT/structured.log" ;;
    attn)
      section "attn: decode variants (heads-first grid) and FlashAttention-3 (bench/attention_gpu.py)"
      left=$(( 570 - ($(date +%s) - T0) ))
      timeout $(( left > 60 ? left : 60 )) python bench/attention_gpu.py --budget-s $(( left > 120 ? left - 60 : 60 )) \
        > "$OUT/attn.log" 2>&1; echo "rc=$?"; tail -40 "$OUT/attn.log" ;;
    pages)
      section "pages: the FP8 decode by page size, pointer gathers against TMA copies (bench/decode_pages_gpu.py)"
      timeout 280 python bench/decode_pages_gpu.py --budget-s 200 > "$OUT/pages.log" 2>&1
      echo "rc=$?"; grep -v "^  ok" "$OUT/pages.log" | tail -60 ;;
    pages-e5m2)
      section "pages-e5m2: the FP8 decode variants' checks on an e5m2 cache (bench/decode_pages_gpu.py --checks-only)"
      timeout 90 python bench/decode_pages_gpu.py --checks-only --formats e5m2 > "$OUT/pages_e5m2.log" 2>&1
      echo "rc=$?"; grep -v "^  ok" "$OUT/pages_e5m2.log" | tail -12 ;;
    profile-fp8kv)
      section "profile-fp8kv: 40 decode steps of long-1024-1024, FP8 cache, bf16 weights (bench/profile_gpu.py)"
      timeout 150 python bench/profile_gpu.py --workload long-1024-1024 --kv-cache-dtype fp8 --warmup-steps 60 \
        --steps 40 > "$OUT/profile_fp8kv.log" 2>&1; echo "rc=$?"; tail -30 "$OUT/profile_fp8kv.log" ;;
    attn-prefill)
      section "attn-prefill: the prefill variants (e4m3 dots among them) and FlashAttention-3 (bench/attention_gpu.py --only prefill)"
      timeout 240 python bench/attention_gpu.py --only prefill --budget-s 200 > "$OUT/attn.log" 2>&1
      echo "rc=$?"; tail -30 "$OUT/attn.log" ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
