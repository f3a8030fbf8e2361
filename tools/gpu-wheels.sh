#!/usr/bin/env bash
# Wheels for a GPU host without network (Python 3.12, x86-64, torch preinstalled): FlashInfer, nbval,
# nbclient and the Jupyter kernel stack. Uses ../shared/tools/gpu-wheels.sh where it exists, then adds
# nbclient (which the GPU suite needs to execute notebooks). Usage: tools/gpu-wheels.sh [DEST] (default .whl)
set -euo pipefail
dest=${1:-.whl}
here=$(cd "$(dirname "$0")/.." && pwd)
if [ -x "$here/../shared/tools/gpu-wheels.sh" ]; then
  bash "$here/../shared/tools/gpu-wheels.sh" "$dest"
else
  echo "no ../shared/tools/gpu-wheels.sh: download flashinfer-python, apache-tvm-ffi, nbval and ipykernel wheels yourself" >&2
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$dest" nbclient
du -sh "$dest"
