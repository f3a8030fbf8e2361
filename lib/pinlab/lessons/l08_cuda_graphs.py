"""Lesson 08, CUDA graphs: what a captured copy reads (issue 21). Experiments only; the lesson's notebook is
still to come, so no notebook imports this module yet (its GPU evidence starts with that notebook).

vLLM decodes under CUDA graphs: the step's kernels are captured once and replayed with the addresses they
captured. A graph refuses a copy from pageable host memory, so every H2D copy it captures reads a pinned
buffer, at replay time: exactly the buffer lesson 03 shows racing when the host rewrites it.

* :data:`VARIANTS`: the ways a step's host metadata can reach a graph's static device input;
* :func:`graph_loop`: one variant through the graph step loop, on the CUDA stream or the emulated
  :class:`pinlab.LaggingStream` (which captures and replays graphs too), counting the steps whose kernels
  read another step's data;
* :func:`every_variant`: the same loop for every variant;
* :func:`host_cost`: host time per step, eager launches against one ``g.replay()``, as the number of
  kernels grows (CUDA only: the emulation says nothing about time).
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import steploop
from ..args import positive_int, positive_number, size_list

__all__ = ["VARIANTS", "RACY", "graph_loop", "every_variant", "host_cost"]

#: How step n's host metadata gets to the graph's static device input, and what the graph captured.
VARIANTS = {
    "captured_reused_pinned": "the graph captured the H2D copy from one pinned buffer the host rewrites "
                              "every step (the race, under replay)",
    "outside_reused_pinned": "the H2D copy from the same reused pinned buffer, enqueued outside the graph "
                             "before each replay (the race, without the graph's help)",
    "snapshot_outside": "the PR (vLLM 0.29): the metadata stays pageable; each step copies a pin_memory() "
                        "snapshot into the static input outside the graph, then replays",
    "ring_graphs": "a ring of pinned buffers, one graph per slot (each captured its slot's copy), every "
                   "slot guarded by an event before the host rewrites it",
    "ring_outside": "lesson 04's event-guarded ring of pinned buffers, copied into the static input outside "
                    "the graph",
}
#: The variants whose copy reads a buffer the host rewrites while the GPU is behind.
RACY = ("captured_reused_pinned", "outside_reused_pinned")


def _variant(value) -> str:
    if value not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {value!r}")
    return value


def graph_loop(variant: str, *, steps: int = 200, n_ints: int = 64, busy_ms: float = 0.1, ring_depth: int = 3,
               stream=None) -> dict:
    """Run ``steps`` decode-like steps whose kernels are one replayed graph.

    Step n writes n into every element of the host metadata (``n_ints`` int32), gets it into the graph's
    static device input as ``variant`` says, keeps the GPU ``busy_ms`` behind, replays the graph (its kernel
    copies the static input to the step's output), and records what the kernel read (a device-to-device
    copy outside the graph). Returns ``received`` (the value step n's kernel read), ``corrupted`` (steps
    that read another step's data), ``host_us`` (median host µs per step, metadata write to replay call;
    emulated: not a time) and ``emulated``.
    """
    variant = _variant(variant)
    steps = positive_int("steps", steps, maximum=100_000)
    n_ints = positive_int("n_ints", n_ints, maximum=1 << 20)
    busy_ms = positive_number("busy_ms", busy_ms, allow_zero=True, maximum=1000.0)
    ring_depth = positive_int("ring_depth", ring_depth, maximum=64)
    s = steploop.cuda_or(stream, "graph_loop()")
    ring = variant in ("ring_graphs", "ring_outside")
    depth = ring_depth if ring else 1
    with s:
        static = torch.zeros(n_ints, dtype=torch.int32, device=s.device)
        out = torch.zeros(n_ints, dtype=torch.int32, device=s.device)
        seen = torch.zeros(steps, dtype=torch.int32, device=s.device)
        if variant == "snapshot_outside":
            slots = [torch.zeros(n_ints, dtype=torch.int32)]                       # pageable metadata
        else:
            slots = [torch.zeros(n_ints, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
        events = [None] * depth
        graphs = []
        for k in range(depth if variant == "ring_graphs" else 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                if variant in ("captured_reused_pinned", "ring_graphs"):
                    static.copy_(slots[k], non_blocking=True)  # captured: this buffer's address, read at replay
                out.copy_(static)                              # the step's kernels read the static input
            graphs.append(g)
        host_ns = []
        for n in range(steps):
            k = n % depth
            t0 = time.perf_counter_ns()
            if events[k] is not None:
                events[k].synchronize()          # the copy that last read slot k has run
            slots[k].fill_(n)                    # the host writes step n's metadata
            if variant == "outside_reused_pinned" or variant == "ring_outside":
                static.copy_(slots[k], non_blocking=True)
            elif variant == "snapshot_outside":
                static.copy_(slots[k].pin_memory(), non_blocking=True)
            s.busy(busy_ms)                      # the rest of the previous step keeps the GPU behind
            graphs[k if variant == "ring_graphs" else 0].replay()
            if ring:
                if events[k] is None:
                    events[k] = s.Event()
                events[k].record()
            host_ns.append(time.perf_counter_ns() - t0)
            seen[n:n + 1].copy_(out[:1])
        s.synchronize()
        received = seen.tolist()
    corrupted = sum(v != n for n, v in enumerate(received))
    return {"variant": variant, "steps": steps, "received": received, "corrupted": corrupted,
            "host_us": statistics.median(host_ns) / 1e3, "emulated": bool(s.emulated), "busy_ms": busy_ms}


def every_variant(variants=None, *, steps: int = 200, n_ints: int = 64, busy_ms: float = 0.1,
                  ring_depth: int = 3, stream=None) -> dict:
    """:func:`graph_loop` for each of ``variants`` (default: all), the same loop and arguments."""
    names = list(VARIANTS) if variants is None else [_variant(v) for v in variants]
    if not names:
        raise ValueError("variants must name at least one variant")
    runs = {v: graph_loop(v, steps=steps, n_ints=n_ints, busy_ms=busy_ms, ring_depth=ring_depth,
                          stream=stream) for v in names}
    return {"steps": steps, "busy_ms": busy_ms,
            "rows": [{k: r[k] for k in ("variant", "corrupted", "host_us", "emulated")} for r in runs.values()],
            "received": {v: r["received"] for v, r in runs.items()}}


def host_cost(kernels=(1, 5, 10, 20, 40), *, repeat: int = 200, numel: int = 256) -> dict:
    """Host µs per step: ``k`` small kernels launched eagerly against one ``g.replay()`` of the same ``k``
    kernels captured in a graph (CUDA only). Returns rows {kernels, eager_us, replay_us} (medians)."""
    from ..args import require_cuda

    require_cuda("host_cost()")
    counts = size_list("kernels", kernels)
    if max(counts) > 1000:
        raise ValueError(f"kernels: at most 1000 per step, got {max(counts)}")
    repeat = positive_int("repeat", repeat, maximum=100_000)
    numel = positive_int("numel", numel, maximum=1 << 24)
    x = torch.zeros(numel, device="cuda")
    rows = []
    for k in counts:
        def step(k=k):
            for _ in range(k):
                x.add_(1.0)
        step()                                    # warm-up: load the kernel's module
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        eager, replay = [], []
        for _ in range(repeat):                   # interleaved: eager and replay in the same rounds
            t0 = time.perf_counter_ns()
            step()
            eager.append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            g.replay()
            replay.append(time.perf_counter_ns() - t0)
            torch.cuda.synchronize()
        rows.append({"kernels": k, "eager_us": statistics.median(eager) / 1e3,
                     "replay_us": statistics.median(replay) / 1e3})
    return {"repeat": repeat, "rows": rows}
