#!/bin/bash
# On the GPU machine: our own A/B runs that settle defaults (no peer needed), one line each to stdout and
# $OUT/forms.log. Each ARG is PRESET:WORKLOAD:EXTRA-FLAGS (flags comma-separated), e.g.
#   bash bench/forms_gpu.sh gpt-oss-20b:seed-512-256:--mxfp4-experts,dense \
#     gpt-oss-20b:seed-512-256:--mxfp4-experts,fp8 qwen3.5-9b:seed-512-256:--mamba-ssm-cache-dtype,bfloat16
# Env: OV_PATH (more PYTHONPATH, e.g. $HOME/fla), FORM_TIMEOUT (seconds a run, default 200).
export PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/forms.log
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$log"
for spec in "$@"; do
  IFS=: read -r preset workload extra <<< "$spec"
  PYTHONPATH=$PWD${OV_PATH:+:$OV_PATH} timeout "${FORM_TIMEOUT:-200}" python3 -m overnight bench throughput \
    --model "$preset" --workload "$workload" --load-format dummy ${extra//,/ } > /tmp/f.log 2>&1
  rc=$?; echo "== rc=$rc $spec" | tee -a "$log"
  { grep '^{' /tmp/f.log | tail -1 || true; [ $rc -ne 0 ] && grep -v '^\s*$' /tmp/f.log | tail -8; } | tee -a "$log"
done
