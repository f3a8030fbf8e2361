"""Build FlashInfer's paged-decode kernel ahead of time (the Dockerfile's RUN step; any machine).

FlashInfer compiles its kernels just in time, on first use, with the CUDA toolkit's nvcc, and keeps
what it built under ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/`` (``FLASHINFER_WORKSPACE_BASE``
defaults to the home folder). Lessons 03, 04 and 07 decode with the same configuration (fp16 query and
KV cache, head_dim 128, int32 indices, no positional encoding, no sliding window, no logits cap: see
``pinlab.paged_kv.FlashInferDecode`` and ``lessons/l04_the_fix.py``), so building it once here spares
the learner the build inside the lesson.

- On a GPU: one plan() and run() of ``pinlab.paged_kv.FlashInferDecode(8, 2, 128, 16)`` on a small batch,
  exactly as the lessons call it: whatever FlashInfer builds for them is built and cached.
- Without a GPU (``docker build`` has none): FlashInfer's JIT spec of the same decode module is compiled
  without being loaded, for the architectures in ``FLASHINFER_CUDA_ARCH_LIST`` (it must be set: no device
  to ask). Keep the same ``FLASHINFER_CUDA_ARCH_LIST`` at run time (the Dockerfile sets it as ENV):
  FlashInfer files its builds by architecture list, so a different list builds again.

It never fails the caller: where FlashInfer, nvcc or the JIT entry point is missing, it says why and exits 0
(the kernel is then built on first use, as without this step). ``--strict`` exits 1 instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

#: the decode configuration the lessons use (FlashInferDecode(8, 2, 128, 16), fp16)
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 128, 16


def warm_on_gpu() -> str:
    import torch
    from pinlab.paged_kv import FlashInferDecode, build_metadata, random_batch

    dec = FlashInferDecode(NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
    rb = random_batch(4, 64, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_QO_HEADS, seed=0, device="cuda")
    meta = build_metadata(rb.block_table, rb.seq_lens.clamp(min=1), PAGE_SIZE)
    dec.plan(meta.indptr_cpu, meta.indices, meta.last_page_len_cpu)
    dec.run(rb.q, rb.k_cache, rb.v_cache)
    torch.cuda.synchronize()
    return "built and loaded on the GPU (plan + run, as the lessons call it)"


def _gen_batch_decode_module():
    """FlashInfer's JIT spec generator for the batch decode module (its home moved between versions)."""
    for mod in ("flashinfer.jit.attention", "flashinfer.jit.attention.modules", "flashinfer.jit"):
        try:
            m = __import__(mod, fromlist=["gen_batch_decode_module"])
        except ImportError:
            continue
        if hasattr(m, "gen_batch_decode_module"):
            return m.gen_batch_decode_module
    raise ImportError("flashinfer has no gen_batch_decode_module in flashinfer.jit[.attention[.modules]]")


def warm_without_gpu() -> str:
    if not os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        raise RuntimeError("no GPU and no FLASHINFER_CUDA_ARCH_LIST: nothing says which architectures to build for")
    import torch

    gen = _gen_batch_decode_module()
    spec = gen(torch.float16, torch.float16, torch.float16, torch.int32, HEAD_DIM, HEAD_DIM,
               0, False, False)  # pos_encoding_mode NONE, no sliding window, no logits soft cap
    spec.build()  # compile only: loading needs the CUDA driver, which a build container lacks
    return f"compiled without a GPU for FLASHINFER_CUDA_ARCH_LIST={os.environ['FLASHINFER_CUDA_ARCH_LIST']!r}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 when the kernel could not be built")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    try:
        import torch

        import flashinfer  # noqa: F401  (the gpu extra)

        how = warm_on_gpu() if torch.cuda.is_available() else warm_without_gpu()
    except Exception as exc:  # noqa: BLE001 - a build step that must not fail the image
        print(f"warm_flashinfer: FlashInfer's decode kernel was not built ahead of time "
              f"({type(exc).__name__}: {str(exc)[:300]}); it is built on first use instead (seconds to minutes)")
        return 1 if args.strict else 0
    print(f"warm_flashinfer: FlashInfer's decode kernel {how} in {time.perf_counter() - t0:.0f} s; "
          f"cached under {os.path.join(base, '.cache', 'flashinfer')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
