#!/bin/bash
# usage: [PEERS="direct relay:1 relay:4 worker:1 worker:4 direct"] [KEEP=1] [DEADLINE_S=540] bash .gpu/kit/go.sh peers
# Issue 15 on one engine: vLLM's own api_server (:$PV) started once; the same loads (1xSTREAMS, PROCSxSTREAMS)
# straight at it and through `sluice gateway --procs N` (:$PG+N) in front of it. Two `--engine openai` workers
# register the server on their own redis-server: `--relay direct` as model $MODEL-direct (the gateway streams
# from vLLM itself) and the worker relay as $MODEL (the gateway streams through the worker).
# PEERS: phases in order: direct | relay:N | worker:N. KEEP=1 leaves server, Redis and workers running
# (setsid) for the next command, which reuses them; a phase that would start after DEADLINE_S seconds
# of this command is skipped and named, so the next command can run it. SERVER=mock (CPU checks) fronts
# loadtest/peers/mock_openai.py --vllm instead (its model is "mock": MODEL=mock).
[ "${BASH_SOURCE[0]}" = "$0" ] && exec bash "$(dirname "$0")/go.sh" peers   # run, not sourced
PEERS=${PEERS:-direct relay:1 relay:4 worker:1 worker:4 direct}
PV=${PV:-8090}; PG=${PG:-8000}; PR=${PR:-6390}; PW=${PW:-8100}
DEADLINE_S=${DEADLINE_S:-540}; PHASE_S=${PHASE_S:-50}
STATE=${STATE:-/tmp/peers_state}
T_CMD=${T_CMD:-$(date +%s)}
PJ=${PJ:-$OUT/peers.jsonl}
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
[ -f $STATE ] && source $STATE
echo "== peers: $PEERS; $(settings); cores $(nproc); gpu mem $(gpu_mem)"

# the engine server, once
if alive "$dpid" && curl -fs -o /dev/null "http://127.0.0.1:$PV/health"; then
  echo "server $dpid still up"
else
  t0=$(ts)
  if [ "${SERVER:-vllm}" = mock ]; then
    setsid python3 loadtest/peers/mock_openai.py --port $PV --vllm --no-eos > "$OUT/server.log" 2>&1 &
  else
    setsid python3 -m vllm.entrypoints.openai.api_server --model "/tmp/m_$MODEL" --served-model-name "$MODEL" \
      --load-format dummy --port $PV --max-model-len "$MAX_MODEL_LEN" --max-num-seqs "$MAX_NUM_SEQS" \
      --gpu-memory-utilization "$GPU_UTIL" ${MAX_BATCHED:+--max-num-batched-tokens "$MAX_BATCHED"} ${VLLM_ARGS:-} \
      > "$OUT/server.log" 2>&1 &
  fi
  dpid=$!
  wait_http "http://127.0.0.1:$PV/health" $dpid "${READY_T:-450}" || { tail -40 "$OUT/server.log"; return 1; }
  echo "server ready after $(el "$t0") s; gpu mem $(gpu_mem)"
  grep -E "non-default args|Using .*backend|FlashAttention version|Maximum concurrency" "$OUT/server.log" | cut -c1-300 | head -8
  MODEL=$MODEL warm openai "http://127.0.0.1:$PV"
fi

# Redis and the two workers registering the server, once
if ! alive "$rpid"; then
  setsid "$(python3 -c 'from sluice.embedded_redis import redis_server_binary as r; print(r())')" --port $PR \
    --bind 127.0.0.1 --save '' --appendonly no --dir /tmp > "$OUT/redis.log" 2>&1 &
  rpid=$!; sleep 1
fi
rurl=redis://127.0.0.1:$PR/0
worker() {  # worker PORT NAME [--relay direct]: an openai worker registering the server as NAME
  setsid python3 -m sluice worker --engine openai --upstream-url "http://127.0.0.1:$PV" --served-model-name "$2" \
    --upstream-capacity "$MAX_NUM_SEQS" --port "$1" --redis-url "$rurl" "${@:3}" >> "$OUT/worker_$2.log" 2>&1 &
}
alive "$wr" || { worker $((PW + 1)) "$MODEL"; wr=$!; }
alive "$wd" || { worker $((PW + 2)) "$MODEL-direct" --relay direct; wd=$!; }
echo "dpid=$dpid rpid=$rpid wr=$wr wd=$wd" > $STATE
wait_http "http://127.0.0.1:$((PW + 1))/health" "$wr" 60 || echo "worker relay not healthy"
wait_http "http://127.0.0.1:$((PW + 2))/health" "$wd" 60 || echo "direct-relay worker not healthy"

# measure TAG NPROC MODEL URL: one load, with the CPU each process tree spent meanwhile
measure() {
  local tag=$1 np=$2 model=$3 url=$4 c0 c1 line
  local names=(server=$dpid redis=$rpid worker=$wr worker_direct=$wd gateway=${gp:-})
  c0=$(python3 "$K/peers_cpu.py" snap "${names[@]}")
  line=$(MODEL=$model clients "$tag" openai "$np" "$url")
  c1=$(python3 "$K/peers_cpu.py" snap "${names[@]}")
  python3 "$K/peers_cpu.py" diff "$line" "$c0" "$c1" | tee -a "$PJ" |
    python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); c=d.pop("cpu", {}); print(json.dumps({k: d.get(k) for k in ("tag","tok_per_s","ttft_p50_ms","ttft_p99_ms","itl_p50_ms","errors","err_kinds")}), {k: (v["cores"], v["max_proc_cores"], v["procs"]) for k, v in c.items()})'
}

# wait_models URL PID NAMES TIMEOUT_S: the gateway's /ready lists every one of NAMES
wait_models() {
  local t0; t0=$(date +%s)
  until curl -fs "$1/ready" 2>/dev/null | python3 -c 'import json,sys; m=json.load(sys.stdin)["models"]; sys.exit(any(n not in m for n in sys.argv[1:]))' $3 2>/dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "process $2 died"; return 1; }
    [ $(( $(date +%s) - t0 )) -ge "$4" ] && { echo "timeout $4 s on $1/ready: $(curl -s "$1/ready")"; return 1; }
    sleep 1
  done
}

skipped=()
for ph in $PEERS; do
  if [ $(( $(date +%s) - T_CMD + PHASE_S )) -gt "$DEADLINE_S" ]; then skipped+=("$ph"); continue; fi
  kind=${ph%%:*}; n=${ph#*:}; gp=
  echo "-- $ph at +$(( $(date +%s) - T_CMD )) s"
  if [ "$kind" = direct ]; then
    export LABEL="direct: vllm api_server $(settings)"
    measure "direct_1x$STREAMS" 1 "$MODEL" "http://127.0.0.1:$PV"
    measure "direct_${PROCS}x$STREAMS" "$PROCS" "$MODEL" "http://127.0.0.1:$PV"
    continue
  fi
  model=$MODEL; [ "$kind" = relay ] && model=$MODEL-direct
  port=$((PG + n)); url=http://127.0.0.1:$port
  export LABEL="sluice gateway --procs $n, $kind relay: $(settings)"
  setsid python3 -m sluice gateway --port $port --redis-url "$rurl" --procs "$n" >> "$OUT/gateway_$kind$n.log" 2>&1 &
  gp=$!
  if wait_models "$url" $gp "$MODEL $MODEL-direct" 60; then
    MODEL=$model warm openai "$url"
    measure "${kind}${n}_1x$STREAMS" 1 "$model" "$url"
    measure "${kind}${n}_${PROCS}x$STREAMS" "$PROCS" "$model" "$url"
    curl -s "$url/metrics" | grep -E "^sluice_gateway_(requests|errors|rejections|retries|migrations)_total" | head -12
  fi
  stop_group $gp 30
done
[ ${#skipped[@]} -gt 0 ] && echo "SKIPPED (deadline): PEERS=\"${skipped[*]}\""

# Sluice's warnings and errors, each message twice at most
python3 - "$OUT"/worker_*.log "$OUT"/gateway_*.log <<'PY'
import collections, json, os, sys
seen = collections.Counter()
for path in filter(os.path.exists, sys.argv[1:]):  # workers kept from an earlier command logged elsewhere
    for line in open(path, errors="replace"):
        s = line.strip()
        try:
            d = json.loads(s) if s.startswith("{") else None
        except ValueError:
            d = None
        if d is None:
            bad = any(k in s for k in ("Traceback", "Error", "error"))
            key, text = s[:80], s[:300]
        else:
            bad = d.get("level") in ("warning", "error", "critical") or "exc" in d
            key = (d.get("logger"), str(d.get("msg"))[:60])
            text = f'{d.get("level")} {d.get("logger")}: {str(d.get("msg"))[:300]} {str(d.get("exc", ""))[-600:]}'
        if bad:
            seen[key] += 1
            if seen[key] <= 2:
                print(path.rsplit("/", 1)[-1], text)
print("repeated:", [(k, v) for k, v in seen.items() if v > 2][:10])
PY
if [ "${KEEP:-0}" != 1 ]; then
  for p in $wd $wr; do stop_group $p 30; done
  stop_group $dpid 60; stop_group $rpid 10; rm -f $STATE; gpu_free
fi
