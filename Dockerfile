# The course in a container: CUDA + torch, the course installed with its gpu and test extras, FlashInfer's
# decode kernel built at image build, JupyterLab on port 8888.
#   make docker                                          # docker build -t pinlab .
#   docker run --rm --gpus all -p 127.0.0.1:8888:8888 pinlab   # then open the URL with the token it prints
# tests/test_docker.py checks this file (and runs hadolint where it is installed).
#
# A -devel image: FlashInfer compiles its kernels with nvcc (just in time). torch 2.11 + CUDA 13.0 is what
# the recorded GPU run used (reports/gpu/latest.json); any CUDA torch image within pyproject's range works.
# Pinned by digest as well as tag (a tag can be pushed again; the digest names one image): the digest of
# pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel as two independent public projects recorded it for their runs
# on it (not read from Docker Hub here). To check it, or to move to another image:
#   docker buildx imagetools inspect pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel   # "Digest: sha256:..."
#   make docker DOCKER_ARGS="--build-arg BASE_IMAGE=pytorch/pytorch:<tag>@sha256:<digest>"
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-devel@sha256:6e8a7a6dedf900096f90190f66f988e7e658cda4f1e6cbc7c17e3a38980a4f89
FROM ${BASE_IMAGE}

# FlashInfer files its JIT builds under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer, by architecture list:
# the same list at build and at run time, so the kernel built below is the one the lessons load.
# (8.0 A100, 8.6/8.9 RTX 30xx/40xx and L4/L40, 9.0a H100/H200; add yours with --build-arg.)
ARG FLASHINFER_CUDA_ARCH_LIST="8.0 8.6 8.9 9.0a"
ENV FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST} \
    FLASHINFER_WORKSPACE_BASE=/opt/flashinfer \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# a learner (uid 1000), not root (tools/lab.py refuses root; JupyterLab warns)
RUN useradd --create-home --uid 1000 --shell /bin/bash learner \
    && mkdir -p /opt/flashinfer /workspace/pinlab \
    && chown learner:learner /opt/flashinfer /workspace/pinlab

WORKDIR /workspace/pinlab
COPY --chown=learner:learner . /workspace/pinlab

# the course (editable: an edit under lib/ is live) with FlashInfer (gpu), JupyterLab and the notebook tools (lab)
# and the test tools (make test)
RUN python -m pip install --no-compile -e ".[gpu,lab,test]"

USER 1000:1000
# FlashInfer's paged-decode kernel, built now rather than in lesson 03: on a build machine without a GPU it
# is compiled for FLASHINFER_CUDA_ARCH_LIST; where that fails the step says why and the image still builds
# (the kernel is then built on first use).
RUN python tools/warm_flashinfer.py

EXPOSE 8888
# JupyterLab on every interface of the container (publish it on 127.0.0.1 only: -p 127.0.0.1:8888:8888);
# it prints the URL with its token.
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--notebook-dir=/workspace/pinlab", "--ServerApp.default_url=/lab/tree/notebooks/00_start_here.ipynb"]
