#!/usr/bin/env bash
# Wheels for running the GPU suite on a CUDA host that has Python 3.12 (x86-64, manylinux) and torch but no
# network: FlashInfer and its FFI layer, nbval, nbclient and the Jupyter kernel stack, with their dependencies,
# LESS every package such a host's image already has (two versions of one package break the install there,
# and a second copy of torch's own dependencies would shadow the image's).
#
# The wheels are pinned in the repository: tools/gpu-wheels.txt names each one (name==version) with the SHA-256 of
# its file (--hash=sha256:...). The GPU host installs with pip's --require-hashes from that committed file, so a
# wheel that is not the one pinned (tampered with, or another build or version of it) is refused there, whatever
# came with it in the same transfer.
#
# Usage (on a machine with network, from the project root):
#   bash tools/gpu-wheels.sh [DEST]            # download exactly the pinned wheels into DEST (default .whl)
#   bash tools/gpu-wheels.sh --relock [DEST]   # resolve afresh (newer versions), write tools/gpu-wheels.txt anew
# The first downloads with pip's --require-hashes from tools/gpu-wheels.txt and checks every file against it again
# (a wheel pip wrote that the file does not pin, or a pin without its wheel, is refused: exit 1, nothing copied to
# DEST). --relock is the deliberate step that changes the pins: review `git diff tools/gpu-wheels.txt` (versions and
# hashes; PyPI shows each file's SHA-256) and commit it. DEST must be empty or hold only what an earlier run wrote
# there (*.whl and SHA256SUMS: emptied first); anything else in it is refused, and so is a DEST that is a symbolic
# link (give the folder it leads to). The script installs nothing; it writes DEST/SHA256SUMS of the wheels it kept
# and prints the install recipe for the GPU host, which installs exactly the pinned wheels, each checked against
# tools/gpu-wheels.txt by pip, into a fresh private folder (mktemp -d; never a fixed world-writable path
# such as /tmp/site, which anyone on the host could have created and filled first):
#   SITE=$(mktemp -d) && python3 -m pip install -q --no-index --find-links DEST --only-binary=:all: --no-deps \
#     --require-hashes --target "$SITE" -r tools/gpu-wheels.txt && export PYTHONPATH="$SITE"
# Environment: PYTHON (default python3) runs pip; MAX_MIB (default 60) is the size the set must stay under; LOCK
# (default tools/gpu-wheels.txt beside this script) is the file of pins.
set -euo pipefail
relock=0
if [[ "${1:-}" == --relock ]]; then
  relock=1
  shift
fi
if [[ "${1:-}" == -* ]]; then
  echo "gpu-wheels.sh: unknown option $1 (usage: bash tools/gpu-wheels.sh [--relock] [DEST])" >&2
  exit 2
fi
dest=${1:-.whl}
py=${PYTHON:-python3}
max_mib=${MAX_MIB:-60}
lock=${LOCK:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gpu-wheels.txt}
if (( ! relock )) && [[ ! -f "$lock" ]]; then
  echo "gpu-wheels.sh: $lock is missing: it pins the wheels (name==version --hash=sha256:...); restore it" \
       "(git checkout -- tools/gpu-wheels.txt) or write it anew with bash tools/gpu-wheels.sh --relock" >&2
  exit 2
fi
if [[ -L "$dest" ]]; then
  # a link would be followed by cp and sha256sum but not by the checks below (find does not enter it): refused
  echo "gpu-wheels.sh: $dest is a symbolic link (to $(readlink -- "$dest")): give the folder itself" \
       "($(readlink -f -- "$dest" || echo '?')) or a new DEST" >&2
  exit 2
fi
if [[ -e "$dest" && ! -d "$dest" ]]; then
  echo "gpu-wheels.sh: $dest exists and is not a folder: give another DEST" >&2
  exit 2
fi
mkdir -p "$dest"
others=$(find "$dest" -mindepth 1 -maxdepth 1 ! \( -type f \( -name '*.whl' -o -name SHA256SUMS -o -name SHA256SUMS.newer \) \) -print -quit)
if [[ -n "$others" ]]; then
  echo "gpu-wheels.sh: $dest holds more than an earlier run's wheels (e.g. $others): refusing to empty it;" \
       "give an empty or new DEST" >&2
  exit 2
fi
old=$(find "$dest" -mindepth 1 -maxdepth 1 -type f | wc -l)
if (( old > 0 )); then
  echo "emptying $dest: $old files of an earlier run"
  find "$dest" -mindepth 1 -maxdepth 1 -type f \( -name '*.whl' -o -name SHA256SUMS -o -name SHA256SUMS.newer \) -delete
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# What a CUDA image with torch already holds (normalized names). Taken from the package list of the image the
# course's GPU runs use (torch 2.11 + CUDA 13, Python 3.12); the GPU image of another provider may need one or
# two of these after all: then add it with `pip download --no-deps ... NAME` and --target install it too.
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# Not needed to run the suite: debugpy, ipykernel's debugger, which the suite never starts (ipykernel imports it
# only where installed; a notebook's kernel runs without it). 5 MB less, so that the newer transformers below fits
# one device call's 64 MiB with the rest.
unneeded="debugpy"

plat=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  plat+=(--platform "${tag}_x86_64")
done
download=(-m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12
          --implementation cp "${plat[@]}")

# unpinned FILE LOCK: where LOCK has no `name==version --hash=sha256:<FILE's SHA-256>` line, print "NAME (sha256
# SUM)" and succeed; where it pins FILE, fail and print nothing
unpinned() {
  local sum
  sum=$(sha256sum -- "$1" | cut -d' ' -f1)
  grep -q -E "^[A-Za-z0-9][^#]*--hash=sha256:${sum}([^0-9a-f]|\$)" "$2" && return 1
  echo "$(basename "$1") (sha256 $sum)"
}

kept=() left=()
mkdir -p "$tmp/w" "$tmp/keep"
if (( relock )); then
  # FlashInfer 0.6.18.post1: the newest release whose wheel fits one transfer (0.7.x is 60-100 MB). It imports with
  # apache-tvm-ffi beside what the image has (its other requirements, CUTLASS DSL and cuDNN frontend, are only
  # needed by kernels the course does not use).
  "$py" "${download[@]}" -d "$tmp/w" --no-deps flashinfer-python==0.6.18.post1 \
    'apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0'
  # nbval (strict notebook tests), nbclient (the suite executes notebooks with it) and a Jupyter kernel, with deps
  "$py" "${download[@]}" -d "$tmp/w" nbval nbclient ipykernel
  for f in "$tmp"/w/*.whl; do
    base=$(basename "$f")
    name=$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')
    if [[ " $(echo $image) $unneeded " == *" $name "* ]]; then
      left+=("$name")
    else
      cp "$f" "$tmp/keep"/
      kept+=("$name")
    fi
  done
  {
    echo "# The wheels tools/gpu-wheels.sh fetches for a GPU host without network (CONTRIBUTING.md, \"Running the GPU"
    echo "# suite\"), pinned: each name==version with the SHA-256 of its one file (Python 3.12, x86-64 manylinux)."
    echo "# The GPU host installs them with pip --require-hashes -r tools/gpu-wheels.txt: any other file is refused."
    echo "# Written by \`bash tools/gpu-wheels.sh --relock\`; review the diff (versions, hashes) before committing it."
    for f in "$tmp"/keep/*.whl; do
      base=$(basename "$f")
      rest=${base#*-}
      name=$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')
      echo "$name==${rest%%-*} --hash=sha256:$(sha256sum -- "$f" | cut -d' ' -f1)"
    done
  } > "$tmp/lock"
else
  # exactly the pinned wheels: pip checks each file's hash against the lock as it downloads it
  "$py" "${download[@]}" -d "$tmp/w" --no-deps --require-hashes -r "$lock"
  # and again here, file by file: every wheel pip wrote is one the lock pins, and every pin has its wheel
  pins=$(grep -c -E '^[A-Za-z0-9]' "$lock" || true)
  for f in "$tmp"/w/*; do
    [[ -e "$f" ]] || continue
    base=$(basename "$f")
    if why=$(unpinned "$f" "$lock"); then
      echo "gpu-wheels.sh: $why is not a wheel $lock pins: refusing the download, nothing copied" \
           "to $dest. If a new version is meant, run bash tools/gpu-wheels.sh --relock and review the diff" >&2
      exit 1
    fi
    cp "$f" "$tmp/keep"/
    kept+=("$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')")
  done
  if (( ${#kept[@]} != pins )); then
    echo "gpu-wheels.sh: pip wrote ${#kept[@]} wheels, $lock pins $pins: refusing the download, nothing copied" \
         "to $dest" >&2
    exit 1
  fi
fi
cp "$tmp"/keep/*.whl "$dest"/
(cd "$dest" && sha256sum -- *.whl > SHA256SUMS)
# A newer transformers for lesson 09's comparison, pinned apart (tools/gpu-wheels-newer.txt) with the packages it
# needs at versions the GPU image lacks (the image has huggingface_hub 1.33.0; transformers 5.25.0 needs >= 2.4.0,
# which needs httpx2), and listed apart (DEST/SHA256SUMS.newer): the GPU host installs them into a folder of its
# own. NEWER_TRANSFORMERS=none leaves them out. With --relock, NEWER_TRANSFORMERS (default 5.25.0) is the release
# resolved, and NEWER_KEEP the names of its requirements that travel with it (the rest the image has; `kernels`,
# which 5.25.0 requires, it imports only where installed).
newer=${NEWER_TRANSFORMERS:-5.25.0}
newer_keep=${NEWER_KEEP:-transformers huggingface-hub httpx2 httpcore2 truststore}
newer_lock=$(dirname "$lock")/gpu-wheels-newer.txt
if [[ "$newer" != none ]] && (( ! relock )) && [[ ! -f "$newer_lock" ]]; then
  echo "gpu-wheels.sh: $newer_lock is missing: no newer transformers for lesson 09 (it replays its comparison)" >&2
  newer=none
fi
if [[ "$newer" != none ]]; then
  mkdir -p "$tmp/n" "$tmp/nkeep"
  newer_ok=1
  if (( relock )); then
    "$py" "${download[@]}" -d "$tmp/n" "transformers==$newer"
    grep '^#' "$newer_lock" > "$tmp/newer_lock" 2>/dev/null || true
    for f in "$tmp"/n/*.whl; do
      [[ -e "$f" ]] || continue
      base=$(basename "$f")
      rest=${base#*-}
      name=$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')
      if [[ " $(echo $newer_keep) " == *" $name "* ]]; then
        cp "$f" "$tmp/nkeep"/
        echo "$name==${rest%%-*} --hash=sha256:$(sha256sum -- "$f" | cut -d' ' -f1)" >> "$tmp/newer_lock"
      fi
    done
  else
    "$py" "${download[@]}" -d "$tmp/n" --no-deps --require-hashes -r "$newer_lock"
    # every wheel pip wrote is one the newer lock pins, and every pin has its wheel; else the whole set stays out
    npins=$(grep -c -E '^[A-Za-z0-9]' "$newer_lock" || true)
    for f in "$tmp"/n/*; do
      [[ -e "$f" ]] || continue
      if why=$(unpinned "$f" "$newer_lock"); then
        echo "gpu-wheels.sh: $why is not the wheel $newer_lock pins: the newer transformers is" \
             "left out (lesson 09 replays its comparison)" >&2
        newer_ok=0
      fi
      cp "$f" "$tmp/nkeep"/
    done
    if (( newer_ok )) && (( $(ls "$tmp"/nkeep | wc -l) != npins )); then
      echo "gpu-wheels.sh: pip wrote $(ls "$tmp"/nkeep | wc -l) wheels, $newer_lock pins $npins: the newer" \
           "transformers is left out (lesson 09 replays its comparison)" >&2
      newer_ok=0
    fi
  fi
  if (( newer_ok )) && ls "$tmp"/nkeep/transformers-*.whl >/dev/null 2>&1; then
    cp "$tmp"/nkeep/*.whl "$dest"/
    (cd "$tmp/nkeep" && sha256sum -- *.whl) > "$dest/SHA256SUMS.newer"
    echo "newer transformers for lesson 09: $(cd "$tmp/nkeep" && ls *.whl | tr '\n' ' ')(in $dest/SHA256SUMS.newer)"
  elif (( newer_ok )); then
    echo "gpu-wheels.sh: no transformers wheel came down for lesson 09: it replays its comparison" >&2
  fi
fi
echo "wheels in $dest: ${kept[*]}"
if (( relock )); then
  echo "left out (the GPU image has them, or the suite does not need them: $unneeded): ${left[*]:-none}"
fi
kib=$(du -sk "$dest" | cut -f1)
echo "total: $((kib / 1024)) MiB in $(ls "$dest"/*.whl | wc -l) wheels; their SHA-256 sums in $dest/SHA256SUMS$(
  [[ -f "$dest/SHA256SUMS.newer" ]] && echo " and $dest/SHA256SUMS.newer")"
if (( kib > max_mib * 1024 )); then
  echo "gpu-wheels.sh: $dest holds over $max_mib MiB (a device call carries at most 64 MiB): leave something out" >&2
  exit 1
fi
if (( relock )); then
  cp "$tmp/lock" "$lock"
  if [[ -f "$tmp/newer_lock" ]]; then
    cp "$tmp/newer_lock" "$newer_lock"
  fi
  echo "wrote $lock: review the change (git diff -- $lock: versions and SHA-256 sums) and commit it; the GPU host" \
       "installs only what it pins"
fi
cat <<MSG
Copy $dest/ to the GPU host (into the project root, whose tools/gpu-wheels.txt pins these wheels), then there, from
the project root: install exactly the pinned wheels, each checked by pip against the SHA-256 in
tools/gpu-wheels.txt (a wheel that differs is refused), into a fresh private folder, and put it on PYTHONPATH:

  SITE=\$(mktemp -d) && python3 -m pip install -q --no-index --find-links $dest --only-binary=:all: --no-deps \\
    --require-hashes --target "\$SITE" -r tools/gpu-wheels.txt && export PYTHONPATH="\$SITE"
  NEWER=\$(mktemp -d) && python3 -m pip install -q --no-index --find-links $dest --only-binary=:all: --no-deps \\
    --require-hashes --target "\$NEWER" -r tools/gpu-wheels-newer.txt && export PINLAB_TRANSFORMERS_NEWER="\$NEWER"
  python3 tools/gpu_suite.py
MSG
