#!/usr/bin/env bash
# Creates the peers' virtual environments, each apart from Sluice's own:
#   $VENVS/vllm-router  vllm-router (vLLM's Rust load balancer, from PyPI)
#   $VENVS/litellm      LiteLLM's proxy, litellm[proxy]
# Idempotent: an existing venv with the package importable is left alone.
set -euo pipefail
VENVS=${VENVS:-/work/venvs}
PY=${PYTHON:-python3.11}
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-}
LITELLM_VERSION=${LITELLM_VERSION:-1.100.0}

make_venv() {  # name, pip spec, check command
    local dir="$VENVS/$1"
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "$3" 2>/dev/null; then
        echo "$1: ready ($dir)"
        return
    fi
    "$PY" -m venv "$dir"
    "$dir/bin/pip" install --quiet --upgrade pip
    "$dir/bin/pip" install --quiet "$2"
    echo "$1: installed ($dir)"
}

mkdir -p "$VENVS"
make_venv vllm-router "vllm-router${VLLM_ROUTER_VERSION:+==$VLLM_ROUTER_VERSION}" "import vllm_router"
make_venv litellm "litellm[proxy]==$LITELLM_VERSION" "import litellm.proxy.proxy_server"
