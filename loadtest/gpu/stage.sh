#!/bin/bash
# Here, before the device session: lay out what each `run` call carries (session.sh says what runs there).
#
#   bash loadtest/gpu/stage.sh DEST
#
# DEST is the checkout the device tool sends (the session's own checkout; a helper's worktree is
# not sent): the calls' folders go under DEST/.gpu/gpu/, which DEST's .git/info/exclude must
# ignore ("/.gpu/"). Inputs: DEST/.gpu/wheels (the GPU kit's wheels: ../shared/gpu/README.md,
# resolve.py) and DEST/.gpu/kit. Here, in this worktree's ignored .gpu/ (under .gpu/stage/, so
# that DEST may be this worktree itself: its .gpu/wheels stays the kit's):
#   .gpu/nixl/   nixl-cu13 (cp312, CUDA 13, ~59 MB) less what vLLM's connector does not load
#                (nixl_ep's three torch builds, C headers, UCX's perftest): ~28 MB; and the meta package `nixl`;
#   .gpu/stage/wheels/ the kit's wheels (hard links), vLLM's less its Rust frontend (vllm-rs, 16 MB packed,
#                run only with VLLM_USE_RUST_FRONTEND=1), and the nixl wheels: the kit's install takes all;
#   .gpu/stage/parts/  those wheels as one tar in PART_MIB parts, and md5.
# Then DEST/.gpu/gpu/p/aa ... (one part each, for the transfer calls: carry .gpu/gpu/p/aa, ...)
# and DEST/.gpu/gpu/proj: this worktree's code + .gpu/kit + .gpu/cur (the last part and md5),
# carried by the measuring calls. A call carries at most 64 MiB with DEST's tracked tree:
# PART_MIB 51 leaves the tree (11.5 MB on 2026-12-03) ~3 MB of room to grow (54 did until the tree passed 10.5 MB).
#
#   REF=HEAD bash loadtest/gpu/stage.sh DEST         # proj from a commit (git archive), not the worktree
#   PROJ_ONLY=1 REF=HEAD bash loadtest/gpu/stage.sh DEST   # only proj again (the parts already staged)
#   REAL_MODEL=DIR ... bash loadtest/gpu/stage.sh DEST     # also a real model's weights: DEST/.gpu/gpu/m/aa
#       ... (one call each, to /tmp/mparts), the last part and the small files in proj/.gpu/model
#       (session.sh assembles /tmp/m_real; dummy weights repeat a token or two, real ones do not)
#
# REF: in a tree others work in, their uncommitted changes would travel with the worktree's
# files and be measured as if they were the code named in the README.
set -e
DEST=${1:?DEST}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
PART_MIB=${PART_MIB:-51}
REF=${REF:-}                # a commit: proj from it (git archive); empty: the worktree's files
PROJ_ONLY=${PROJ_ONLY:-0}   # 1: keep the staged parts (.gpu/stage/parts, DEST/.gpu/gpu/p), make proj again
REAL_MODEL=${REAL_MODEL:-}  # a model folder (one *.safetensors): its weights in parts, DEST/.gpu/gpu/m/aa ...
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
G=$DEST/.gpu/gpu
git -C "$DEST" check-ignore -q .gpu/gpu || { echo "$DEST/.gpu/gpu is not ignored there"; exit 1; }
git -C "$SRC" check-ignore -q .gpu/x || { echo "$SRC/.gpu is not ignored: echo /.gpu/ >> .git/info/exclude"; exit 1; }
N=$SRC/.gpu/nixl W=$SRC/.gpu/stage/wheels P=$SRC/.gpu/stage/parts
mkdir -p "$G" "$N"

parts() {   # the wheels in parts: .gpu/stage/parts and DEST/.gpu/gpu/p
  if ! ls "$N"/nixl_cu13-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d "$N" "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
    zip -q -d "$N"/nixl_cu13-*.whl 'nixl_ep_cu13/*' "nixl_cu13-$NIXL_VERSION.data/headers/*" 'nixl_cu13.libs/ucx/libucx_perftest*'
  fi

  rm -rf "$W" "$P" && mkdir -p "$W" "$P"
  for f in "$DEST"/.gpu/wheels/*.whl; do
    case ${f##*/} in vllm-*) cp "$f" "$W/" ;; *) ln "$f" "$W/" ;; esac
  done
  zip -q -d "$W"/vllm-*.whl vllm/vllm-rs
  ln "$N"/*.whl "$W/"
  tar cf - -C "$SRC/.gpu/stage" wheels | split -b "${PART_MIB}M" - "$P/part."
  cat "$P"/part.* | md5sum > "$P/md5"

  rm -rf "$G/p"
  last=$(ls "$P"/part.* | tail -1)
  for f in "$P"/part.*; do
    [ "$f" = "$last" ] && continue
    mkdir -p "$G/p/${f##*.}" && cp "$f" "$P/md5" "$G/p/${f##*.}/"
  done
}
[ "$PROJ_ONLY" = 1 ] || parts
last=$(ls "$P"/part.* | tail -1)

# the project: REF's files, or this worktree's (tracked and new, not ignored), less pictures and result data
rm -rf "$G/proj" && mkdir -p "$G/proj/.gpu/cur"
keep() { grep -Ev '\.(png|jsonl|json|txt)$' | grep -E '^(gateway|engine_worker|sluice|loadtest)/|^pyproject.toml$'; }
if [ -n "$REF" ]; then
  (cd "$SRC" && git ls-tree -r --name-only "$REF" | keep | xargs git archive "$REF" --) | tar xf - -C "$G/proj"
  echo "proj: $(git -C "$SRC" rev-parse --short "$REF") (git archive)"
else
  (cd "$SRC" && git ls-files --cached --others --exclude-standard | keep | tar cf - -T -) | tar xf - -C "$G/proj"
  echo "proj: the worktree's files ($(git -C "$SRC" status --porcelain -- gateway engine_worker sluice loadtest | wc -l) changed or new)"
fi
cp -r "$DEST/.gpu/kit" "$G/proj/.gpu/kit"
rm -rf "$G/m"
if [ -n "$REAL_MODEL" ]; then
  weights=$(cd "$REAL_MODEL" && ls ./*.safetensors | head -1) && weights=${weights#./}
  M=$SRC/.gpu/stage/model && rm -rf "$M" && mkdir -p "$M" "$G/proj/.gpu/model/files"
  split -b "${PART_MIB}M" "$REAL_MODEL/$weights" "$M/m."
  cat "$M"/m.* | md5sum > "$G/proj/.gpu/model/md5" && echo "$weights" > "$G/proj/.gpu/model/weights"
  for f in "$REAL_MODEL"/*; do   # the small files, less those the kit's tok/ has already (the tokenizer: 3.5 MB)
    case $f in *.safetensors) continue ;; esac
    cmp -s "$f" "$DEST/.gpu/kit/tok/${f##*/}" || cp "$f" "$G/proj/.gpu/model/files/"
  done
  mlast=$(ls "$M"/m.* | tail -1)
  for f in "$M"/m.*; do
    if [ "$f" = "$mlast" ]; then cp "$f" "$G/proj/.gpu/model/"; else mkdir -p "$G/m/${f##*.}" && cp "$f" "$G/m/${f##*.}/"; fi
  done
fi
cp "$last" "$P/md5" "$G/proj/.gpu/cur/"

tree_bytes=$(cd "$DEST" && git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
echo "$(ls "$W" | wc -l) wheels; DEST's tree (sent with every call): $tree_bytes bytes; limit 67108864 a call"
for d in "$G"/p/* "$G"/m/* "$G/proj"; do
  [ -d "$d" ] || continue
  echo "carry ${d#"$DEST"/}: $(du -sb "$d" | cut -f1) bytes, with the tree $(( $(du -sb "$d" | cut -f1) + tree_bytes ))"
done
