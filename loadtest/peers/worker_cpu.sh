#!/bin/bash
# Worker and gateway CPU per one-token chat request through `sluice up --gateway-procs 1`, read
# from /proc while loadtest/gpu/short_load.py keeps STREAMS streams busy (figures in
# loadtest/peers/README.md, "The worker's side of a short request").
#
#   bash loadtest/peers/worker_cpu.sh LABEL PORT [ENGINE] [VAR=value ...]
#   bash loadtest/peers/worker_cpu.sh sim 8490 sim
#   bash loadtest/peers/worker_cpu.sh vllm 8491 vllm
#   bash loadtest/peers/worker_cpu.sh vllm-gateway-tokenizes 8492 vllm \
#        SLUICE_GATEWAY_TOKENIZER="$HOME/.cache/sluice/models/SmolLM2-135M-Instruct"
#
# STREAMS (default 64 with sim, 128 with vllm) and MEASURE_S (default 30) change the load.
cd "$(dirname "$0")/../.." || exit 1
label=$1 port=$2 engine=${3:-sim}
shift 3 2>/dev/null || shift $#
model=sim; [ "$engine" = vllm ] && model=SmolLM2-135M-Instruct
streams=${STREAMS:-$([ "$engine" = vllm ] && echo 128 || echo 64)}
measure=${MEASURE_S:-30}
log=$(mktemp /tmp/worker-cpu-XXXX.log)
(env "$@" setsid .venv/bin/python -m sluice up --engine "$engine" --gateway-procs 1 --port "$port" > "$log" 2>&1 &)
for _ in $(seq 180); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
wpid=$(grep -o '"msg":"started worker-0 (pid [0-9]*' "$log" | grep -o '[0-9]*$' | head -1)
gpid=$(pgrep -f "sluice --log-level INFO gateway --host 127.0.0.1 --port $port" -n)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
served() { grep -c '"sluice.access"' "$log"; }
.venv/bin/python loadtest/gpu/short_load.py "http://127.0.0.1:$port" "$model" --tag "$label" --levels "$streams" \
  --procs 1 --max-tokens 1 --warmup-s 3 --measure-s $((measure + 12)) > "$log.load" 2>&1 &
sleep 8
w0=$(ticks "$wpid"); g0=$(ticks "$gpid"); r0=$(served)
sleep "$measure"
w1=$(ticks "$wpid"); g1=$(ticks "$gpid"); r1=$(served)
hz=$(getconf CLK_TCK); n=$((r1 - r0))
echo "$label: $n requests in ${measure} s; worker $(( (w1 - w0) * 1000000 / hz / n )) us a request," \
     "gateway $(( (g1 - g0) * 1000000 / hz / n )) us a request"
wait
tail -1 "$log.load" | cut -c1-300
pkill -INT -f "sluice up --engine $engine --gateway-procs 1 --port $port"; sleep 4
rm -f "$log" "$log.load"
