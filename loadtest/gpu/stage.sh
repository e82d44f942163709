#!/bin/bash
# Here, before the device session: lay out what each `run` call carries (session.sh says what runs there).
#
#   bash loadtest/gpu/stage.sh DEST [PARTS]
#
# DEST is the checkout the device tool sends (the session's own checkout; a helper's worktree is
# not sent): everything goes under DEST/.gpu/gpu/, which DEST's .git/info/exclude must ignore
# ("/.gpu/"). PARTS (default DEST/.gpu/parts) holds the GPU kit's part.* and md5 (../shared/gpu/README.md).
#   DEST/.gpu/gpu/p/aa ... : one part each, for the transfer calls (carry .gpu/gpu/p/aa, then ab, ...);
#   DEST/.gpu/gpu/proj     : this worktree's code + .gpu/kit + .gpu/cur (the last part, md5, nixl.tar,
#                            nixl.md5), carried by the measuring calls.
# The nixl wheels: nixl-cu13 (cp312, CUDA 13, ~59 MB) less what vLLM's connector does not load
# (nixl_ep's three torch builds, C headers, UCX's perftest): ~28 MB; and the `nixl` meta package.
set -e
DEST=${1:?DEST}; PARTS=${2:-$DEST/.gpu/parts}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
KIT=${KIT:-$DEST/.gpu/kit}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
G=$DEST/.gpu/gpu
git -C "$DEST" check-ignore -q .gpu/gpu || { echo "$DEST/.gpu/gpu is not ignored there"; exit 1; }
mkdir -p "$G" "$SRC/.gpu/nixl"

# nixl wheels -> nixl.tar (once)
W=$SRC/.gpu/nixl
if ! ls "$W"/nixl_cu13-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$W" "nixl-cu13==$NIXL_VERSION" "nixl==$NIXL_VERSION"
  zip -q -d "$W"/nixl_cu13-*.whl 'nixl_ep_cu13/*' "nixl_cu13-$NIXL_VERSION.data/headers/*" 'nixl_cu13.libs/ucx/libucx_perftest*'
fi
tar cf "$W.tar" -C "$W" . && md5sum < "$W.tar" > "$W.md5"

# one folder per part: hard links, no copies
rm -rf "$G/p"
last=$(ls "$PARTS"/part.* | tail -1)
for f in "$PARTS"/part.*; do
  [ "$f" = "$last" ] && continue
  mkdir -p "$G/p/${f##*.}" && ln "$f" "$G/p/${f##*.}/" && cp "$PARTS/md5" "$G/p/${f##*.}/"
done

# the project: this worktree's files (tracked and new, not ignored), less pictures and result data
rm -rf "$G/proj" && mkdir -p "$G/proj/.gpu/cur"
(cd "$SRC" && git ls-files --cached --others --exclude-standard | grep -Ev '\.(png|jsonl|json|txt)$' |
  grep -E '^(gateway|engine_worker|sluice|loadtest)/|^pyproject.toml$' | tar cf - -T -) | tar xf - -C "$G/proj"
cp -r "$KIT" "$G/proj/.gpu/kit"
cp "$last" "$PARTS/md5" "$W.tar" "$W.md5" "$G/proj/.gpu/cur/"

tree_bytes=$(cd "$DEST" && git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
echo "DEST's tree (sent with every call): $tree_bytes bytes; limit 67108864 a call"
for d in "$G"/p/* "$G/proj"; do
  echo "carry ${d#"$DEST"/}: $(du -sb "$d" | cut -f1) bytes, with the tree $(( $(du -sb "$d" | cut -f1) + tree_bytes ))"
done
