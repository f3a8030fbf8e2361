#!/usr/bin/env bash
# Between two chained device calls (pending/README.md): unpack the call's res.tgz into this checkout, commit what it
# renewed as that call's GPU evidence, apply the next pending slice (a `git am` series under pending/) and remove
# it, then print --plan's last line. All of it must happen within the 30 s a device machine stays warm after a
# reply, so it is one command:
#
#   bash tools/chain_slice.sh <files_at>/res.tgz [pending/s64b.mbox]
#
# It refuses a checkout with uncommitted changes (they would go into the evidence commit) and a slice that does not
# apply (git am is aborted: the checkout is left as the evidence commit made it).
set -euo pipefail

usage() { echo "usage: bash tools/chain_slice.sh RES_TGZ [NEXT_SLICE_MBOX]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
res=$1
next=${2:-}
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f "$res" ] || { echo "chain_slice: no file $res (the call's res.tgz, under its files_at)" >&2; exit 2; }
if [ -n "$next" ] && [ ! -f "$next" ]; then
  echo "chain_slice: no slice $next (the pending/*.mbox to apply next)" >&2; exit 2
fi
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "chain_slice: the checkout has uncommitted changes; commit or stash them first (they would go into the" \
       "evidence commit)" >&2
  git status --short --untracked-files=no >&2
  exit 2
fi

tar xzf "$res" -C "$root"
dirs=()
for d in reports notebooks solutions; do [ -e "$d" ] && dirs+=("$d"); done
git add -A -- "${dirs[@]}"
if git diff --cached --quiet; then
  echo "chain_slice: $res changed nothing in reports/, notebooks/ or solutions/"
else
  git commit -q -m "GPU evidence from $(basename "$(dirname "$res")")/$(basename "$res")"
  echo "chain_slice: committed $(git diff --stat HEAD~1 | tail -1 | sed 's/^ *//')"
fi

if [ -n "$next" ]; then
  if ! git am -q "$next"; then
    git am --abort
    echo "chain_slice: $next does not apply here; the evidence is committed, nothing else changed" >&2
    exit 1
  fi
  git rm -q "$next"
  git commit -q -m "pending: $(basename "$next") applied"
  echo "chain_slice: applied $next ($(git log --oneline -1 | cut -c1-60))"
fi

PYTHONPATH=lib "${PYTHON:-python3}" tools/gpu_suite.py --plan | tail -1
