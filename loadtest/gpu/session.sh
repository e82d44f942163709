#!/bin/bash
# One device session for issues 24 and 26, run by a daemon that outlives the 10-minute calls.
#
#   bash loadtest/gpu/session.sh start WAIT_S TOTAL_S   # install once, start the daemon, wait WAIT_S, collect
#   bash loadtest/gpu/session.sh wait WAIT_S            # wait for the daemon (at most WAIT_S), collect
#   bash loadtest/gpu/session.sh daemon                 # (start runs it in its own session) the phases in order
#
# From the project's root on the device, with .gpu/kit (the GPU kit) and .gpu/cur (the last
# part and md5; stage.sh lays it out, the earlier parts already in /tmp/parts). The daemon has TOTAL_S from
# `start` for everything; in order of importance:
#   1. routing (issue 24): 4 vLLM workers sharing the GPU, a gateway per routing arm, 4
#      workloads x the arms, each arm as long as the time left allows (routing_gpu.py);
#   2. migration (issue 24): fresh workers under VLLM_BATCH_INVARIANT=1, 4x64 greedy streams,
#      one worker SIGKILLed, every stream checked token for token (migration.py);
#   3. disagg (issue 26): agg worker + prefill/decode pair joined by NixlConnector (disagg_gpu.py).
# Each phase ends by its deadline (MIG_S and PD_S are kept for the last two).
# A real model (stage.sh REAL_MODEL=DIR; its earlier parts already in /tmp/mparts) lands in
# /tmp/m_real: SLUICE_BENCH_DUMMY=0 MIGRATION_ARGS="--model /tmp/m_real --tokenizer /tmp/m_real".
# SHAPE=8b: the routing fleet runs Llama-3-8B's shape (dummy weights) instead of 1b, whose prefill costs
# ~8x more (where cache routing saves TTFT and throughput); plan2 may run the other shape (block_bytes below).
# ROUTING=0: no routing phase. MIG_FIRST=1: migration first (by MIG_S from its start; what it leaves goes to routing), for a
# session where migration matters most and routing may be cut.
# With ROUTING1_S set, the routing phase is two: the first gets ROUTING1_S (ROUTING_ARGS), then
# the daemon writes $S/ask and waits up to PLAN_WAIT_S for $S/plan2: more routing_gpu arguments
# for a second fleet (other engine settings, say: --kv-blocks 4096 --label kv4096), or "skip".
# `wait` returns as soon as the daemon asks, so the next call can answer:
#   echo '--kv-blocks 4096 --label kv4096' > /tmp/sess/plan2; bash /tmp/sess/session.sh wait 560
# PD_S=0 skips the disagg phase and its NIXL probe (and the tokenizer's cost, measured before). `collect` puts
# the results, charts, the NIXL probe, the daemon's log and the logs (tar.gz) in $OUT: 8 files.
#
# CPU rehearsal (sim workers, rehearsal sizes, no install):
#   ENGINE=sim PY=/work/main/.venv/bin/python TOKENIZER=~/.cache/sluice/models/SmolLM2-135M-Instruct \
#     OUT=/tmp/sess-out S=/tmp/sess bash loadtest/gpu/session.sh start 400 400
SELF=$(readlink -f "$0")   # before the cd: `start` copies this file, and a relative $0 breaks once in the project
cd "${ROOT:-$(dirname "$SELF")/../..}" || exit 1   # the project (ROOT: the daemon runs from its copy in $S)
mode=${1:-wait}
S=${S:-/tmp/sess}                      # the daemon's state: out/, daemon.log, end, done
OUT=${OUT:-/tmp/out}
ENGINE=${ENGINE:-vllm}
PY=${PY:-python3}
MIG_S=${MIG_S:-240}                    # kept for the migration phase
PD_S=${PD_S:-330}                      # kept for the disagg phase, less when routing would get under ROUTING_MIN_S
ROUTING_MIN_S=${ROUTING_MIN_S:-480}
ROUTING1_S=${ROUTING1_S:-}                # set: the routing phase is split in two (above)
MIG_FIRST=${MIG_FIRST:-0}                 # 1: the migration phase before routing (above)
ROUTING=${ROUTING:-1}                     # 0: no routing phase (a migration-only session)
PLAN_WAIT_S=${PLAN_WAIT_S:-90}
SHAPE=${SHAPE:-1b}                        # the dummy model's shape: 1b (Llama-3.2-1B) or 8b (Llama-3-8B), model() below
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays off
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

install() {   # the kit's install: vLLM, its deps and the nixl wheels, from the parts (stage.sh)
  [ -f /tmp/site/.done ] && return 0
  mkdir -p /tmp/parts && cp .gpu/cur/part.* .gpu/cur/md5 /tmp/parts/ 2>/dev/null
  log "parts here: $(ls /tmp/parts | tr '\n' ' ')"
  K=$PWD/.gpu/kit
  # shellcheck source=/dev/null
  source "$K/common.sh" && source "$K/install.sh" || return 1
  python3 -c "from nixl._api import nixl_agent; print('nixl', nixl_agent.__module__)" || log "nixl does not import"
}

real_model() {   # /tmp/m_real: a real model sent in parts (stage.sh REAL_MODEL=DIR); none sent: nothing to do
  [ -f .gpu/model/md5 ] || return 0
  mkdir -p /tmp/mparts /tmp/m_real && cp .gpu/model/m.* /tmp/mparts/ || return 1
  if [ "$(cat /tmp/mparts/m.* | md5sum)" != "$(cat .gpu/model/md5)" ]; then
    log "model parts: md5 differs ($(ls /tmp/mparts | tr '\n' ' '))"; return 1
  fi
  cat /tmp/mparts/m.* > "/tmp/m_real/$(cat .gpu/model/weights)" && cp .gpu/kit/tok/* /tmp/m_real/ && cp -r .gpu/model/files/. /tmp/m_real/ &&
    log "model /tmp/m_real: $(ls /tmp/m_real | tr '\n' ' ')"
}

model() {   # /tmp/m_1b and /tmp/m_8b: Llama-3.2-1B's and Llama-3-8B's shapes with the default model's tokenizer (dummy weights)
  local shape
  for shape in 1b 8b; do
    mkdir -p "/tmp/m_$shape" && cp "${KIT:-.gpu/kit}"/tok/* "/tmp/m_$shape/" || return 1
    model_config "/tmp/m_$shape/config.json" "$shape" || return 1
  done
}
model_config() {
  python3 - "$@" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
shapes = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
          "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)}
c.update(shapes[sys.argv[2]], max_position_embeddings=8192, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
}
# A KV block (16 tokens, bf16) of each shape: layers x KV heads x head_dim x 2 (K and V) x 2 bytes x 16.
# A second fleet of the other shape (plan2): --model /tmp/m_1b --block-bytes 524288 --served m1b --label m1b
block_bytes() { case $SHAPE in 8b) echo $(( 32 * 8 * 128 * 2 * 2 * 16 )) ;; *) echo $(( 16 * 8 * 64 * 2 * 2 * 16 )) ;; esac; }

gpu_free() {   # what a phase left on the GPU goes before the next phase's engines start
  command -v nvidia-smi >/dev/null || return 0
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    log "leftover gpu pid $p: $(ps -o args= -p "$p" | cut -c1-100)"; kill -9 "$p"
  done
  log "gpu: $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader)"
}

phase() {   # phase NAME DEADLINE_EPOCH CMD...: runs CMD, killed 30 s past its deadline at the latest
  local name=$1 deadline=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 60 ]; then log "== $name skipped: ${left} s left"; return 1; fi
  log "== $name: ${left} s"
  timeout -k 45 $(( left + 20 )) "$@"
  log "== $name rc=$? after $(( left - (deadline - $(date +%s)) )) s"
  gpu_free
}

migration() {   # migration DEADLINE_EPOCH (daemon's locals: out, model, tok, sim)
  phase migration "$1" $PY -m loadtest.gpu.routing_gpu --phase migration --engine "$ENGINE" \
    --model "$model" --tokenizer "$tok" --deadline "$1" --out "$out" "${sim[@]}" $MIGRATION_ARGS
}

daemon() {
  local end; end=$(cat "$S/end")
  export KIT=$PWD/kit PYTHONPATH=/tmp/site:$PWD
  local out=$S/out sim=() tok=${TOKENIZER:-/tmp/m_$SHAPE} model=/tmp/m_$SHAPE
  mkdir -p "$out"
  if [ "$ENGINE" = sim ]; then sim=(--quick); model=none; else model || return 1; fi
  local routing_s=$(( end - $(date +%s) - 40 - MIG_S - PD_S ))   # 40: the NIXL probe and the tokenizer's cost
  if [ "$routing_s" -lt "$ROUTING_MIN_S" ] && [ "$PD_S" -gt 0 ]; then   # issue 24 first: disagg gives way
    PD_S=$(( PD_S - (ROUTING_MIN_S - routing_s) )); [ "$PD_S" -lt 0 ] && PD_S=0
  fi
  log "daemon: engine $ENGINE, $(( end - $(date +%s) )) s in all (migration $MIG_S, disagg $PD_S)"
  gpu_free
  local nixl_tries="cuda;cpu:tcp,self"
  if [ "$ENGINE" != sim ] && [ "$PD_S" -gt 0 ]; then   # which NIXL transfer works here (~20 s): the disagg phase tries it first
    timeout 200 $PY -m loadtest.gpu.nixl_probe --timeout-s 20 --out "$out/nixl_probe.json"
    nixl_tries=$($PY -c 'import json, sys
try:
    ok = json.load(open(sys.argv[1]))["first_ok"] or {}
except (OSError, ValueError):
    ok = {}
first = ok.get("buffer", "") + ("" if ok.get("ucx_tls", "(").startswith("(") else ":" + ok["ucx_tls"])
print(";".join(dict.fromkeys(t for t in (first, *sys.argv[2].split(";")) if t)))' "$out/nixl_probe.json" "$nixl_tries")
    log "nixl tries: $nixl_tries"
  fi
  [ "$PD_S" -gt 0 ] && { $PY -m loadtest.gpu.tokenize_cost --tokenizer "$tok" --out "$out/tokenize_cost.json" || true; }
  local mig_end=$(( end - PD_S ))
  if [ "$MIG_FIRST" = 1 ]; then   # migration now, by MIG_S from here; routing then has until end - PD_S
    mig_end=$(( $(date +%s) + MIG_S )); [ "$mig_end" -gt $(( end - PD_S )) ] && mig_end=$(( end - PD_S ))
    migration "$mig_end"
    MIG_S=0
  fi
  local r1_end=$(( end - MIG_S - PD_S ))
  [ -n "$ROUTING1_S" ] && r1_end=$(( $(date +%s) + ROUTING1_S ))
  [ "$ROUTING" = 1 ] && phase routing $r1_end $PY -m loadtest.gpu.routing_gpu --phase routing --engine "$ENGINE" \
    --model "$model" --tokenizer "$tok" --deadline $r1_end --out "$out" "${sim[@]}" \
    --block-bytes "$(block_bytes)" --served "m$SHAPE" --label "m$SHAPE" $ROUTING_ARGS
  if [ -n "$ROUTING1_S" ]; then   # the second fleet, as the next call says (or the default)
    touch "$S/ask"; log "ASK: routing phase 1 done; waiting ${PLAN_WAIT_S} s for $S/plan2"
    local waited=0
    while [ ! -f "$S/plan2" ] && [ "$waited" -lt "$PLAN_WAIT_S" ]; do sleep 1; waited=$(( waited + 1 )); done
    local plan2; plan2=$(cat "$S/plan2" 2>/dev/null || echo "${PLAN2_DEFAULT:-skip}")
    log "plan2 after ${waited} s: $plan2"
    if [ "$plan2" != skip ]; then
      phase routing2 $(( end - MIG_S - PD_S )) $PY -m loadtest.gpu.routing_gpu --phase routing --engine "$ENGINE" \
        --model "$model" --tokenizer "$tok" --deadline $(( end - MIG_S - PD_S )) --out "$out" "${sim[@]}" \
        $ROUTING_ARGS $plan2
    fi
  fi
  [ "$MIG_FIRST" = 1 ] || [ "$MIG_S" = 0 ] || migration $(( end - PD_S ))   # MIG_S=0: no migration phase
  local connector=(--connector NixlConnector --nixl-tries "$nixl_tries" --first-timeout-s 45)
  [ "$ENGINE" = sim ] && connector=()
  [ "$PD_S" -gt 0 ] && phase disagg "$end" $PY -m loadtest.gpu.disagg_gpu --engine "$ENGINE" --model "$model" --tokenizer "$tok" \
    --deadline "$end" --out "$out/disagg" "${connector[@]}" "${sim[@]}" $DISAGG_ARGS
  log "daemon done"
  touch "$S/done"
}

collect() {   # what the daemon has so far -> $OUT (at most 8 files come back)
  local out=$S/out
  mkdir -p "$OUT" /tmp/logcut
  for f in "$out/results.jsonl" "$out/routing_gpu.png" "$out/tokenize_cost.json" "$out/nixl_probe.json" \
           "$out/disagg/disagg.json" "$out/disagg/disagg.png" "$S/daemon.log"; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
  # the logs, the engines' probe lines and the joined requests (loadtest/gpu/diagnose.py)
  rm -rf /tmp/logcut/* && (cd "$out" && find . -name '*.log' -o -name '*.jsonl' ! -name results.jsonl | while read -r f; do
    mkdir -p "/tmp/logcut/$(dirname "$f")"; tail -c 8000000 "$f" > "/tmp/logcut/$f"; done)
  tar czf "$OUT/logs.tgz" -C /tmp/logcut . 2>/dev/null
  ls -l "$OUT"
}

wait_daemon() {   # wait_daemon SECONDS: until the daemon is done or SECONDS pass
  local until=$(( $(date +%s) + $1 )) shown=0
  while [ ! -f "$S/done" ] && [ "$(date +%s)" -lt "$until" ]; do
    if [ -f "$S/ask" ] && [ ! -f "$S/plan2" ]; then tail -n +$(( shown + 1 )) "$S/daemon.log" | cut -c1-400; log "the daemon asks for plan2"; return; fi
    sleep 5
    local lines; lines=$(wc -l < "$S/daemon.log")   # whole lines only: one being written waits (tail showed it twice)
    if [ "$lines" -gt "$shown" ]; then sed -n "$(( shown + 1 )),${lines}p" "$S/daemon.log" | cut -c1-400; shown=$lines; fi
  done
  [ -f "$S/done" ] && log "the daemon is done" || log "the daemon is still running ($(( $(cat "$S/end") - $(date +%s) )) s to its end)"
}

case $mode in
  start)
    t0=$(date +%s)
    wait_s=${2:?WAIT_S} total_s=${3:?TOTAL_S}
    if [ -f "$S/end" ] && [ ! -f "$S/done" ]; then log "a daemon is running already"; wait_daemon "$wait_s"; collect; exit 0; fi
    rm -rf "$S" && mkdir -p "$S"
    if [ "$ENGINE" != sim ]; then
      command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
      install || { log "install failed"; exit 1; }
      real_model || { log "the real model's parts did not assemble"; exit 1; }
    fi
    echo $(( t0 + total_s )) > "$S/end"
    log "install done after $(( $(date +%s) - t0 )) s; the daemon ends by $(date -u -d @"$(cat "$S/end")" +%H:%M:%S)"
    cp "$SELF" "$S/session.sh" || { log "cannot copy $SELF"; exit 1; }   # the daemon reads this copy; later calls: bash /tmp/sess/session.sh wait N
    # The daemon runs from a copy of the project: a later call that carries no checkout removes
    # the carried one (2026-12-02: the phases after routing found no 'loadtest' module).
    mkdir -p "$S/proj" && cp -r gateway engine_worker sluice loadtest "$S/proj/" && cp -r .gpu/kit "$S/proj/kit"
    export PYTHONPATH=/tmp/site:$S/proj
    # its own session, deaf to SIGHUP: it outlives this call (Python's setsid: the binary may be missing there)
    ROOT=$S/proj $PY -c 'import os, signal, sys; os.setsid(); signal.signal(signal.SIGHUP, signal.SIG_IGN)
os.execvp(sys.argv[1], sys.argv[1:])' bash "$S/session.sh" daemon > "$S/daemon.log" 2>&1 < /dev/null &
    wait_daemon $(( wait_s - ($(date +%s) - t0) ))
    collect ;;
  wait) wait_daemon "${2:-560}"; collect ;;
  daemon) daemon ;;
  collect) collect ;;
  *) echo "usage: $0 start WAIT_S TOTAL_S | wait WAIT_S | collect"; exit 2 ;;
esac
