#!/bin/bash
# usage (on the device, from the repo root, as the lead runs the GPU kit; see routing_gpu.py):
#   bash loadtest/gpu/routing.sh routing   [routing_gpu.py flags]   # call 1: 4 workloads x 4 routing arms
#   bash loadtest/gpu/routing.sh migration [routing_gpu.py flags]   # call 2: SIGKILL under 4x64 greedy streams
#   bash loadtest/gpu/routing.sh disagg    [disagg_gpu.py flags]    # P/D pair vs aggregated (issue 26): $OUT/disagg.json
# Carry .gpu/kit (tokenizer, install scripts) and, on a machine not yet installed, .gpu/cur (the last part).
# Writes $OUT/results.jsonl, $OUT/routing_gpu.png, $OUT/tokenize_cost.json, $OUT/logs/.
cd "$(dirname "$0")/../.." || exit 1
phase=${1:-routing}; shift
t_start=$(date +%s)
K=$PWD/.gpu/kit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays off
if [ ! -f /tmp/site/.done ]; then   # a fresh machine: the kit's install (all parts in /tmp/parts by now)
  mkdir -p /tmp/parts; cp .gpu/cur/* /tmp/parts/ 2>/dev/null
  source "$K/common.sh" && source "$K/install.sh" || exit 1
fi
# The 1B Llama shape (Llama-3.2-1B's dimensions) with the default model's tokenizer; dummy weights.
mkdir -p /tmp/m_1b && cp "$K"/tok/* /tmp/m_1b/ || exit 1
python3 - /tmp/m_1b/config.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
         head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
# Leave ~40 s of the 10-minute call for the workers' shutdown and the files' return.
deadline=$(( t_start + ${BUDGET_S:-520} ))
if [ "$phase" = routing ]; then
  python3 -m loadtest.gpu.tokenize_cost --tokenizer /tmp/m_1b --out "$OUT/tokenize_cost.json" || true
fi
if [ "$phase" = disagg ]; then
  python3 -m loadtest.gpu.disagg_gpu --engine vllm --model /tmp/m_1b --deadline "$deadline" --out "$OUT" "$@"
else
  python3 -m loadtest.gpu.routing_gpu --phase "$phase" --model /tmp/m_1b --deadline "$deadline" --out "$OUT" "$@"
fi
rc=$?
echo "== routing.sh $phase done rc=$rc after $(( $(date +%s) - t_start )) s"
