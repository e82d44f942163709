#!/bin/bash
# usage (device, repo root; the GPU kit in .gpu/kit with this script and embed_gpu.py copied in):
#   [EMB_MODEL=m8b] [LIMIT_S=570] bash .gpu/kit/embed_gpu.sh [new] [old] [direct]
# new: `sluice up` of the code in .gpu/new if there (a git archive of the commit to measure), else the
#   checkout (cwd = the repo root), with one vLLM embedding worker (--task embed),
#   embedded Redis, dummy weights; old: the same with the code in .gpu/old (git archive of an older
#   commit's gateway, engine_worker, sluice), started from that folder: `python -m` puts its cwd first on
#   sys.path, so cwd and PYTHONPATH both point there; direct: vLLM's own OpenAI server on the same folder
#   (--runner pooling --convert embed), the same settings; then the 3 short inputs' vectors compared.
#   embed_gpu.py makes the checks and measurements, one JSON line each in $OUT/results.jsonl, with the
#   CPU seconds of the worker (its main process; its descendants, vLLM's engine core, apart) and the gateway's
#   processes per request. A step that would not end within LIMIT_S of the command's start (NEED_* s
#   each) is skipped and written to /tmp/todo: run `bash .gpu/kit/embed_gpu.sh $(cat /tmp/todo)` next, on
#   the same warm machine.
cd "$(dirname "$0")/../.." || exit 1
T0=$(date +%s)
ARGS="$*"
source .gpu/kit/common.sh
mkdir -p /tmp/parts; cp .gpu/p*/* /tmp/parts/ 2>/dev/null
echo "parts here: $(ls /tmp/parts | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
source "$K/install.sh" || exit 1
LEN=2048 SEQS=256 UTIL=0.85 BATCHED=8192
REPO=$PWD
export EMB_MODEL=${EMB_MODEL:-m8b}
case $EMB_MODEL in m8b) export EMBED_DIM=4096 ;; m135) export EMBED_DIM=576 ;; esac
C=(python3 "$K/embed_gpu.py")
echo "settings: model $EMB_MODEL (dummy weights, dim $EMBED_DIM) max_model_len $LEN max_num_seqs $SEQS gpu_util $UTIL batched $BATCHED"
: > /tmp/todo
# EAGER=1: enforce_eager on both sides (no torch.compile, no CUDA graphs: engine starts of ~1 min instead of ~2)
EAGER_JSON=; EAGER_FLAG=; [ "${EAGER:-0}" = 1 ] && EAGER_JSON=', "enforce_eager": true' EAGER_FLAG=--enforce-eager
echo "eager: ${EAGER:-0}"
declare -A NEED=([new]=${NEED_NEW:-260} [old]=${NEED_OLD:-220} [direct]=${NEED_DIRECT:-200})

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

# sluice_arm NAME SRC: `sluice up` with the code in SRC (cwd and PYTHONPATH), the checks, the measurements
sluice_arm() {
  local name=$1 src=$2 log=$OUT/sluice_$1.log
  gpu_free
  for i in $(seq 30); do curl -s -o /dev/null http://127.0.0.1:8000/ || break; sleep 1; done
  export SLUICE_WORKER_VLLM_ENGINE_ARGS="{\"load_format\": \"dummy\", \"gpu_memory_utilization\": $UTIL, \"max_num_batched_tokens\": $BATCHED$EAGER_JSON}"
  echo "== sluice up ($name code: $src), embedding worker; SLUICE_WORKER_VLLM_ENGINE_ARGS=$SLUICE_WORKER_VLLM_ENGINE_ARGS"
  (cd "$src" && PYTHONPATH=/tmp/site:$src python3 -c '
import importlib.util as u, os
print("resolves from cwd", os.getcwd(), ":", *(u.find_spec(m).origin for m in ("sluice", "gateway", "engine_worker.pooling", "engine_worker.engines.vllm_pooling")))')
  echo "pyc before: $(find "$src"/engine_worker "$src"/gateway "$src"/sluice -name '*.pyc' 2>/dev/null | wc -l) under $src"
  touch /tmp/stamp_$name; sleep 1
  t0=$(ts)
  (cd "$src" && unset PYTHONDONTWRITEBYTECODE && PYTHONPATH=/tmp/site:$src exec setsid python3 -m sluice up --engine vllm --model /tmp/m_$EMB_MODEL \
    --served-model-name $EMB_MODEL --port 8000 \
    --worker-arg=--task=embed --worker-arg=--vllm-max-model-len=$LEN --worker-arg=--vllm-max-num-seqs=$SEQS \
    > "$log" 2>&1) &
  upid=$!
  if wait_http http://127.0.0.1:8000/ready $upid 330; then
    echo "sluice ($name) ready after $(el "$t0") s; gpu mem $(gpu_mem); $(curl -s http://127.0.0.1:8000/ready)"
    ps -o pid=,ppid=,args= --ppid $upid | cut -c1-200
    wpid=$(ps -o pid=,args= --ppid $upid | awk '/ worker --engine/ {print $1; exit}')
    gwpid=$(ps -o pid=,args= --ppid $upid | awk '/ gateway --host/ {print $1; exit}')
    echo "worker pid $wpid cwd $(readlink /proc/$wpid/cwd) PYTHONPATH $(tr '\0' '\n' < /proc/$wpid/environ | grep ^PYTHONPATH=)"
    echo "worker's descendants: $(ps -o pid=,comm= --ppid $wpid | tr '\n' ' ')"
    echo "gateway pid $gwpid, its children: $(ps -o pid= --ppid $gwpid | wc -l)"
    export CPU_PIDS="worker=$wpid,gateway=$gwpid"
    timeout 150 "${C[@]}" short http://127.0.0.1:8000 $name /tmp/vec_$name.json "$RES"
    timeout 300 "${C[@]}" big http://127.0.0.1:8000 $name "$RES" 3
    unset CPU_PIDS
    cp /tmp/vec_$name.json "$OUT/" 2>/dev/null
    curl -s http://127.0.0.1:8000/metrics | grep -E "^sluice_gateway_(requests|errors|rejections|retries)_total" | head -20
  else
    echo "sluice ($name) not ready after $(el "$t0") s"; tail -40 "$log"
  fi
  stop_group $upid 60
  echo "pyc written since the start under $src: $(find "$src"/engine_worker "$src"/gateway "$src"/sluice -name '*.pyc' -newer /tmp/stamp_$name | wc -l)" \
    "(vllm_pooling: $(find "$src"/engine_worker -name 'vllm_pooling*.pyc' -newer /tmp/stamp_$name | wc -l));" \
    "under the other tree: $(for t in "$REPO" "$REPO/.gpu/old" "$REPO/.gpu/new"; do [ -d "$t" ] || continue; [ "$t" != "$src" ] && echo "${t#$REPO}:$(find "$t"/engine_worker "$t"/gateway "$t"/sluice -name '*.pyc' -newer /tmp/stamp_$name | wc -l)"; done | tr '\n' ' ')"
  echo "== sluice_$name.log: $(grep -c Traceback "$log") Traceback lines"
  log_summary "$log"
  gpu_free
}

for step in "$@"; do
  gone=$(( $(date +%s) - T0 ))
  if [ -n "${NEED[$step]:-}" ] && [ $(( gone + ${NEED[$step]} )) -gt "${LIMIT_S:-570}" ]; then
    echo "SKIPPED $step: $gone s gone, needs ~${NEED[$step]} s: left in /tmp/todo"; echo "$step" >> /tmp/todo; continue
  fi
  case $step in
  new) sluice_arm new "$([ -d "$REPO/.gpu/new" ] && echo "$REPO/.gpu/new" || echo "$REPO")" ;;
  old) sluice_arm old "$REPO/.gpu/old" ;;
  direct)
    gpu_free
    echo "== vLLM's own server, --runner pooling --convert embed"
    t0=$(ts)
    setsid python3 -m vllm.entrypoints.openai.api_server --model /tmp/m_$EMB_MODEL --served-model-name $EMB_MODEL \
      --load-format dummy --port 8090 --max-model-len $LEN --max-num-seqs $SEQS --gpu-memory-utilization $UTIL \
      --max-num-batched-tokens $BATCHED --runner pooling --convert embed $EAGER_FLAG > "$OUT/direct_serve.log" 2>&1 &
    dpid=$!
    if wait_http http://127.0.0.1:8090/health $dpid 300; then
      echo "vLLM server ready after $(el "$t0") s; gpu mem $(gpu_mem)"
      echo "server's descendants: $(ps -o pid=,comm= --ppid $dpid | tr '\n' ' ')"
      export CPU_PIDS="server=$dpid"
      timeout 150 "${C[@]}" short http://127.0.0.1:8090 vllm /tmp/vec_vllm.json "$RES"
      timeout 300 "${C[@]}" big http://127.0.0.1:8090 vllm "$RES" 3
      unset CPU_PIDS
      cp /tmp/vec_vllm.json "$OUT/" 2>/dev/null
    else
      echo "vLLM server not ready after $(el "$t0") s"; tail -40 "$OUT/direct_serve.log"
    fi
    stop_group $dpid 60
    echo "== direct_serve.log: $(grep -c Traceback "$OUT/direct_serve.log") Traceback lines"
    log_summary "$OUT/direct_serve.log"
    gpu_free
    ;;
  *) echo "unknown step $step (new, old, direct)" ;;
  esac
done
for pair in "new old" "new vllm" "old vllm"; do
  set -- $pair
  [ -f /tmp/vec_$1.json ] && [ -f /tmp/vec_$2.json ] && [ ! -f /tmp/cmp_$1_$2 ] &&
    "${C[@]}" compare /tmp/vec_$1.json /tmp/vec_$2.json "$RES" && touch /tmp/cmp_$1_$2
done
for f in "$OUT"/*.log; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15000000 ] && xz -T0 "$f"; done
echo "todo: $(cat /tmp/todo | tr '\n' ' ')"
echo "== embed_gpu.sh $ARGS done after $(( $(date +%s) - T0 )) s"
