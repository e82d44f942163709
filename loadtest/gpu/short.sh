#!/bin/bash
# Issue 22 on a GPU: short requests (max_tokens 1) and 128-token streams, vLLM's own OpenAI server
# against `sluice up` (its gateway) and Sluice's worker alone; one engine start per side, the
# same engine settings (the GPU kit's common.sh), dummy weights of the default model's shape
# (m135) unless MODEL_SHORT is set.
#
#   bash loadtest/gpu/short.sh direct    # on the device, from the project's root
#   bash loadtest/gpu/short.sh sluice
#
# The kit (../shared/gpu/README.md: .gpu/kit, and its wheels in parts, the last in .gpu/cur)
# must be laid out as for go.sh; results go to $OUT/results.jsonl, a line per load.
# CLIENT=lean: loads through loadtest/peers/load.py's client instead (short_load.py), with
# Sluice's stall series after each load ($OUT/stalls-*.txt) and its log kept ($OUT/sluice_up.log.xz);
# LENS="1" STREAMS="64" for fewer loads (defaults "1 16" and "64 256").
# Figures and how they were read: loadtest/gpu/h100-2026-12-06-short/README.md.
cd "$(dirname "$0")/../.." || exit 1
source .gpu/kit/common.sh
mkdir -p /tmp/parts; cp .gpu/cur/* /tmp/parts/ 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
source "$K/install.sh" || exit 1
MODEL=${MODEL_SHORT:-m135}
loads() {   # loads PREFIX MODE URL: the same loads on any path
  LEN=1 N=${N1:-2048} clients "$1_len1_1x64" "$2" 1 "$3"
  LEN=1 N=${N1:-2048} clients "$1_len1_4x64" "$2" 4 "$3"
  LEN=128 N=256 clients "$1_len128_4x64" "$2" 4 "$3"
}
lean() {   # lean PREFIX URL: one-token and 16-token chat streams through load.py's client (short_load.py)
  for len in ${LENS:-1 16}; do
    for streams in ${STREAMS:-64 256}; do
      python3 loadtest/gpu/short_load.py "$2" "$MODEL" --tag "$1_len$len" --levels $streams --procs 4 \
        --max-tokens $len --out "$RES"
      stalls "$1_len${len}_$streams"
    done
  done
}
# stalls NAME: Sluice's processes' stall series so far (sluice/stalls.py: event-loop lag, GC
# pauses; the gateway's queue wait; the worker's requests and those it took as the gateway's ids) into $OUT/stalls-NAME.txt, cumulative; nothing for vLLM's server
stalls() {
  [ -n "$wurl" ] || return 0
  { curl -s http://127.0.0.1:8000/metrics
    curl -s -H "authorization: Bearer $SLUICE_INTERNAL_TOKEN" "$wurl/metrics"
  } | grep -E "^sluice_(gateway|worker)_(event_loop_lag|gc_pause|queue_wait)_seconds_(bucket|count|sum)|^sluice_worker_(gateway_prompt_ids|requests)_total" \
    > "$OUT/stalls-$1.txt"
}
# CLIENT=lean: the loads of lean() instead (the kit's lg.py may bound itself at these rates)
measure() { if [ "${CLIENT:-lg}" = lean ]; then lean "$1" "$3"; else loads "$@"; fi; }
case $1 in
direct)
  export LABEL="vllm api_server $(settings)"
  gpu_free
  setsid python3 -m vllm.entrypoints.openai.api_server --model "/tmp/m_$MODEL" --served-model-name "$MODEL" \
    --load-format dummy --port 8090 --max-model-len "$MAX_MODEL_LEN" --max-num-seqs "$MAX_NUM_SEQS" \
    --gpu-memory-utilization "$GPU_UTIL" --max-num-batched-tokens "$MAX_BATCHED" > "$OUT/direct_serve.log" 2>&1 &
  dpid=$!; t0=$(ts)
  if wait_http http://127.0.0.1:8090/health $dpid 450; then
    echo "vLLM server ready after $(el "$t0") s"
    warm openai http://127.0.0.1:8090
    measure direct openai http://127.0.0.1:8090
  else tail -30 "$OUT/direct_serve.log"; fi
  stop_group $dpid 60; gpu_free ;;
sluice)
  export LABEL="sluice $(settings)"
  gpu_free
  export SLUICE_INTERNAL_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
  export SLUICE_WORKER_VLLM_ENGINE_ARGS="{\"load_format\": \"dummy\", \"gpu_memory_utilization\": $GPU_UTIL, \"max_num_batched_tokens\": $MAX_BATCHED}"
  setsid python3 -m sluice up --engine vllm --model "/tmp/m_$MODEL" --served-model-name "$MODEL" --port 8000 \
    --worker-arg=--vllm-max-model-len="$MAX_MODEL_LEN" --worker-arg=--vllm-max-num-seqs="$MAX_NUM_SEQS" \
    > "$OUT/sluice_up.log" 2>&1 &
  upid=$!; t0=$(ts)
  if wait_http http://127.0.0.1:8000/ready $upid 450; then
    echo "sluice ready after $(el "$t0") s"
    rurl=$(grep -o 'redis://[0-9.:]*/0' "$OUT/sluice_up.log" | head -1)
    wurl=$(python3 -c 'import sys; from sluice.commands.bench import _worker_url; print(_worker_url(*sys.argv[1:]))' "$rurl" "$MODEL")
    echo "gateway processes: $(grep -o 'starting [0-9]* gateway processes[^"]*' "$OUT/sluice_up.log" | head -1); cores $(nproc)"
    warm openai http://127.0.0.1:8000
    measure gw openai http://127.0.0.1:8000
    # each gateway process's memory, and whether it mapped torch (it loads its tokenizer without)
    for p in $(pgrep -f "sluice --log-level [A-Z]* gateway"); do
      echo "gateway process $p: $(grep VmRSS /proc/$p/status | tr -s ' '), libtorch mapped: $(grep -c libtorch /proc/$p/maps)"
    done | tee "$OUT/gateway-memory.txt"
    [ "${CLIENT:-lg}" = lean ] || LEN=1 N=${N1:-2048} clients "worker_len1_4x64" worker 4 "$wurl"
    curl -s http://127.0.0.1:8000/metrics | grep -E "^sluice_gateway_(errors|rejections|retries|migrations)_total" | head
    grep -E '"level": ?"(warning|error)"|Traceback' "$OUT/sluice_up.log" | cut -c1-300 | sort | uniq -c | sort -rn | head -15
  else tail -40 "$OUT/sluice_up.log"; fi
  stop_group $upid 120; gpu_free
  xz -T0 -6 "$OUT/sluice_up.log" ;;  # every request's access line (ttft, queue wait, pid): read afterwards
esac
echo "== short.sh $1 done"
