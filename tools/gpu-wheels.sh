#!/usr/bin/env bash
# Wheels for running the GPU suite on a CUDA host that has Python 3.12 (x86-64, manylinux) and torch but no
# network: FlashInfer and its FFI layer, nbval, nbclient and the Jupyter kernel stack, with their dependencies,
# LESS every package such a host's image already has (two versions of one package break the install there,
# and a second copy of torch's own dependencies would shadow the image's).
#
# Usage (on a machine with network, from the project root):  bash tools/gpu-wheels.sh [DEST]   (default .whl)
# DEST must be empty or hold only what an earlier run wrote there (*.whl and SHA256SUMS: emptied first);
# anything else in it is refused, and so is a DEST that is a symbolic link (give the folder it leads to). The script installs nothing; it writes DEST/SHA256SUMS of the wheels it
# kept and prints the install recipe for the GPU host, which checks them and installs exactly those into a
# fresh private folder (mktemp -d; never a fixed world-writable path such as /tmp/site, which anyone on the
# host could have created and filled first):
#   SITE=$(mktemp -d) && (cd DEST && sha256sum --strict -c SHA256SUMS && python3 -m pip install -q --no-index \
#     --no-deps --target "$SITE" $(awk '{print $2}' SHA256SUMS)) && export PYTHONPATH="$SITE"
# Environment: PYTHON (default python3) runs pip; MAX_MIB (default 60) is the size the set must stay under.
set -euo pipefail
dest=${1:-.whl}
py=${PYTHON:-python3}
max_mib=${MAX_MIB:-60}
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

plat=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  plat+=(--platform "${tag}_x86_64")
done
download=(-m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12
          --implementation cp "${plat[@]}")

# FlashInfer 0.6.18.post1: the newest release whose wheel fits one transfer (0.7.x is 60-100 MB). It imports with
# apache-tvm-ffi beside what the image has (its other requirements, CUTLASS DSL and cuDNN frontend, are only
# needed by kernels the course does not use).
"$py" "${download[@]}" -d "$tmp/w" --no-deps flashinfer-python==0.6.18.post1 \
  'apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0'
# nbval (strict notebook tests), nbclient (the suite executes notebooks with it) and a Jupyter kernel, with deps
"$py" "${download[@]}" -d "$tmp/w" nbval nbclient ipykernel

kept=() left=()
for f in "$tmp"/w/*.whl; do
  base=$(basename "$f")
  name=$(echo "${base%%-*}" | tr 'A-Z_.' 'a-z--')
  if [[ " $(echo $image) " == *" $name "* ]]; then
    left+=("$name")
  else
    cp "$f" "$dest"/
    kept+=("$name")
  fi
done
(cd "$dest" && sha256sum -- *.whl > SHA256SUMS)
# A newer transformers for lesson 09's comparison (l09.audit_newer), listed apart in SHA256SUMS.newer: installed
# into a folder of its own, never on the suite's PYTHONPATH (the lesson hooks the image's 5.17 internals).
# 5.24.0: the newest release whose requirements the image meets (5.25.0 asks kernels>=0.19.1).
newer=${NEWER_TRANSFORMERS:-5.24.0}
"$py" "${download[@]}" -d "$tmp/n" --no-deps "transformers==$newer"
newer_whl=$(cd "$tmp/n" && ls transformers-*.whl 2>/dev/null | head -1 || true)
if [[ -n "$newer_whl" ]]; then
  cp "$tmp/n/$newer_whl" "$dest"/
  (cd "$dest" && sha256sum -- "$newer_whl" > SHA256SUMS.newer)
  echo "newer transformers for lesson 09: $newer_whl (in $dest/SHA256SUMS.newer)"
else
  echo "gpu-wheels.sh: no transformers==$newer wheel came down: lesson 09 replays its comparison" >&2
fi
echo "wheels in $dest: ${kept[*]}"
echo "left out (the GPU image has them): ${left[*]:-none}"
kib=$(du -sk "$dest" | cut -f1)
echo "total: $((kib / 1024)) MiB in $(ls "$dest"/*.whl | wc -l) wheels; their SHA-256 sums in $dest/SHA256SUMS"
if (( kib > max_mib * 1024 )); then
  echo "gpu-wheels.sh: $dest holds over $max_mib MiB (a device call carries at most 64 MiB): leave something out" >&2
  exit 1
fi
cat <<MSG
Copy $dest/ to the GPU host (into the project root), then there, from the project root: check the wheels
against SHA256SUMS, install exactly those into a fresh private folder, and put it on PYTHONPATH:

  SITE=\$(mktemp -d) && (cd $dest && sha256sum --strict -c SHA256SUMS && python3 -m pip install -q --no-index \\
    --no-deps --target "\$SITE" \$(awk '{print \$2}' SHA256SUMS)) && export PYTHONPATH="\$SITE"
  NEWER=\$(mktemp -d) && (cd $dest && sha256sum --strict -c SHA256SUMS.newer && python3 -m pip install -q \\
    --no-index --no-deps --target "\$NEWER" \$(awk '{print \$2}' SHA256SUMS.newer)) && export PINLAB_TRANSFORMERS_NEWER="\$NEWER"
  python3 tools/gpu_suite.py
MSG
