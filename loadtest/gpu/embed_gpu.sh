#!/bin/bash
# usage (device, repo root; the GPU kit in .gpu/kit with this script and embed_gpu.py copied in):
#   [GUARD_S=330] bash .gpu/kit/embed_gpu.sh [sluice] [direct]
# sluice: `sluice up` with one vLLM embedding worker (--task embed), embedded Redis, m135 dummy weights;
# direct: vLLM's own OpenAI server on the same folder (--runner pooling --convert embed), the same
# settings; then the 3 short inputs' vectors of both compared. embed_gpu.py makes the checks and
# measurements, one JSON line each in $OUT/results.jsonl. direct is skipped once GUARD_S seconds have
# passed since the command began (then run it in a next command on the same warm machine).
cd "$(dirname "$0")/../.." || exit 1
T0=$(date +%s)
source .gpu/kit/common.sh
mkdir -p /tmp/parts; cp .gpu/p*/* /tmp/parts/ 2>/dev/null
echo "parts here: $(ls /tmp/parts | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
source "$K/install.sh" || exit 1
LEN=2048 SEQS=256 UTIL=0.85 BATCHED=8192
C=(python3 "$K/embed_gpu.py")
echo "settings: model m135 (dummy weights) max_model_len $LEN max_num_seqs $SEQS gpu_util $UTIL batched $BATCHED"

log_summary() {  # warnings, errors and tracebacks of a log (each message twice at most)
  python3 - "$1" <<'PY'
import collections, json, sys
seen, shown = collections.Counter(), 0
keys = ("Traceback", "Error", "error", "WARNING", "non-default args", "FlashAttention version", "ready", "took",
        "prefix caching", "chunked prefill", "pooling", "Pooler")
for line in open(sys.argv[1], errors="replace"):
    s = line.strip()
    try:
        d = json.loads(s) if s.startswith("{") else None
    except ValueError:
        d = None
    if d is not None and (d.get("level") in ("warning", "error", "critical") or "exc" in d):
        key = (d.get("logger"), str(d.get("msg"))[:60])
        text = f'{d.get("level")} {d.get("logger")}: {str(d.get("msg"))[:300]} {str(d.get("exc", ""))[-1500:]}'
    elif d is None and any(k in s for k in keys):
        key, text = s[:80], s[:300]
    else:
        continue
    seen[key] += 1
    if seen[key] <= 2 and shown < 60:
        print(text)
        shown += 1
print("repeated:", [(k, v) for k, v in seen.items() if v > 2][:10])
PY
}

for step in "$@"; do
  case $step in
  sluice)
    gpu_free
    export SLUICE_WORKER_VLLM_ENGINE_ARGS="{\"load_format\": \"dummy\", \"gpu_memory_utilization\": $UTIL, \"max_num_batched_tokens\": $BATCHED}"
    echo "== sluice up, embedding worker; SLUICE_WORKER_VLLM_ENGINE_ARGS=$SLUICE_WORKER_VLLM_ENGINE_ARGS"
    t0=$(ts)
    setsid python3 -m sluice up --engine vllm --model /tmp/m_m135 --served-model-name m135 --port 8000 \
      --worker-arg=--task=embed --worker-arg=--vllm-max-model-len=$LEN --worker-arg=--vllm-max-num-seqs=$SEQS \
      > "$OUT/sluice_up.log" 2>&1 &
    upid=$!
    if wait_http http://127.0.0.1:8000/ready $upid 300; then
      echo "sluice ready after $(el "$t0") s; gpu mem $(gpu_mem); $(curl -s http://127.0.0.1:8000/ready)"
      timeout 120 "${C[@]}" short http://127.0.0.1:8000 sluice /tmp/vec_sluice.json "$RES"
      timeout 240 "${C[@]}" big http://127.0.0.1:8000 sluice "$RES" 3
      cp /tmp/vec_sluice.json "$OUT/" 2>/dev/null
      curl -s http://127.0.0.1:8000/metrics | grep -E "^sluice_gateway_(requests|errors|rejections|retries)_total" | head -20
    else
      echo "sluice not ready after $(el "$t0") s"; tail -40 "$OUT/sluice_up.log"
    fi
    stop_group $upid 60
    echo "== sluice_up.log: $(grep -c Traceback "$OUT/sluice_up.log") Traceback lines"
    log_summary "$OUT/sluice_up.log"
    gpu_free
    ;;
  direct)
    gone=$(( $(date +%s) - T0 ))
    if [ $gone -gt "${GUARD_S:-330}" ]; then echo "SKIPPED direct: $gone s gone"; continue; fi
    gpu_free
    echo "== vLLM's own server, --runner pooling --convert embed"
    t0=$(ts)
    setsid python3 -m vllm.entrypoints.openai.api_server --model /tmp/m_m135 --served-model-name m135 \
      --load-format dummy --port 8090 --max-model-len $LEN --max-num-seqs $SEQS --gpu-memory-utilization $UTIL \
      --max-num-batched-tokens $BATCHED --runner pooling --convert embed > "$OUT/direct_serve.log" 2>&1 &
    dpid=$!
    if wait_http http://127.0.0.1:8090/health $dpid 220; then
      echo "vLLM server ready after $(el "$t0") s; gpu mem $(gpu_mem)"
      timeout 120 "${C[@]}" short http://127.0.0.1:8090 vllm /tmp/vec_vllm.json "$RES"
      timeout 240 "${C[@]}" big http://127.0.0.1:8090 vllm "$RES" 3
      cp /tmp/vec_vllm.json "$OUT/" 2>/dev/null
      [ -f /tmp/vec_sluice.json ] && "${C[@]}" compare /tmp/vec_sluice.json /tmp/vec_vllm.json "$RES"
    else
      echo "vLLM server not ready after $(el "$t0") s"; tail -40 "$OUT/direct_serve.log"
    fi
    stop_group $dpid 60
    echo "== direct_serve.log: $(grep -c Traceback "$OUT/direct_serve.log") Traceback lines"
    log_summary "$OUT/direct_serve.log"
    gpu_free
    ;;
  *) echo "unknown step $step (sluice, direct)" ;;
  esac
done
for f in "$OUT"/*.log; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15000000 ] && xz -T0 "$f"; done
echo "== embed_gpu.sh $* done after $(( $(date +%s) - T0 )) s"
