"""Lesson 08, CUDA graphs: what a captured copy reads (issue 21): the experiments of
``notebooks/src/08_cuda_graphs.py``.

vLLM decodes under CUDA graphs: the step's kernels are captured once and replayed with the addresses they
captured. A graph refuses a copy from pageable host memory, so every H2D copy it captures reads a pinned
buffer, at replay time: exactly the buffer lesson 03 shows racing when the host rewrites it.

* :data:`VARIANTS`: the ways a step's host metadata can reach a graph's static device input;
* :func:`graph_loop`: one variant through the graph step loop, on the CUDA stream or the emulated
  :class:`pinlab.LaggingStream` (which captures and replays graphs too), counting the steps whose kernels
  read another step's data;
* :func:`every_variant`: the same loop for every variant;
* :func:`staging_cost`: host µs per step of each variant's staging, in short interleaved rounds (CUDA only);
* :func:`host_cost`: host time per step, eager launches against one ``g.replay()``, as the number of
  kernels grows (CUDA only: the emulation says nothing about time);
* :func:`flashinfer_graph_decode`: real paged decode under graph replay (FlashInfer's CUDA-graph wrappers,
  ``plan()`` outside the graph, ``run()`` captured), the metadata fed three ways, wrong outputs counted
  against the fp32 reference (CUDA and FlashInfer only); :func:`flashinfer_graph_runs`: every way, as a
  small summary the notebook records (or why FlashInfer could not run);
* :func:`graph_memory`: the device memory a captured graph's private pool and its static buffers hold, per
  batch size, and the pinned bytes of a staging ring (CUDA only);
* :func:`quiet_refusal`: around a capture the notebook expects torch to refuse: torch's warning that the
  refused graph is empty is left out (the refusal is what the cell reports);
* :func:`blocking_verdicts`: the captured copy's race under ``CUDA_LAUNCH_BLOCKING=1`` (a child process), judged
  by timing and by order (lesson 03's heisenbug, with a graph).

(About 520 lines: the emulated loop, the GPU experiments and the argument checks they share, each error
naming its argument and bound, belong to this lesson alone; split out, they would renew every lesson's
evidence.)
"""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch

from .. import steploop
from ..args import INT32_MAX, positive_int, positive_number
from ..claims import Reasons
from ..device import require_cuda
from ..timing import interleaved

__all__ = ["VARIANTS", "RACY", "RINGS", "FLASHINFER_VARIANTS", "graph_loop", "every_variant", "staging_cost",
           "host_cost", "decode_metadata", "flashinfer_graph_decode", "flashinfer_graph_runs", "graph_memory",
           "HOST_COST_COLUMNS", "STAGING_COLUMNS", "MEMORY_COLUMNS", "refusals_left_text", "WHY", "quiet_refusal",
           "blocking_verdicts", "verdicts_run"]

#: torch's UserWarning when a capture ends with no work recorded (torch/cuda/graphs.py ``capture_end``, raised in
#: ATen/cuda/CUDAGraph.cpp): after a refused call it names torch's own file by its absolute path, the machine's
EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"


@contextlib.contextmanager
def quiet_refusal():
    """``with l08.quiet_refusal(), torch.cuda.graph(g): ...``: a capture torch refuses ends with an empty graph, and
    torch then warns "The CUDA Graph is empty ..." with the path of its own file on this machine. The notebook
    reports the refusal itself; that warning alone is left out, only inside this block (elsewhere it is a real
    diagnosis: a capture on the wrong stream)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EMPTY_GRAPH_WARNING, category=UserWarning)
        yield

#: How step n's host metadata gets to the graph's static device input, and what the graph captured.
VARIANTS = {
    "captured_reused_pinned": "the graph captured the H2D copy from one pinned buffer the host rewrites "
                              "every step (the race, under replay)",
    "outside_reused_pinned": "the H2D copy from the same reused pinned buffer, enqueued outside the graph "
                             "before each replay (the race, without the graph's help)",
    "snapshot_outside": "the PR (vLLM 0.29): the metadata stays pageable; each step copies a pin_memory() "
                        "snapshot into the static input outside the graph, then replays",
    "ring_graphs": "a ring of pinned slabs, one graph per slot (each captured its slot's copy), every "
                   "slot guarded by an event before the host rewrites it",
    "ring_outside": "lesson 04's event-guarded slab ring: every tensor of a step in one pinned slab, one copy "
                    "into the static input outside the graph",
}
#: The variants whose copy reads a buffer the host rewrites while the GPU is behind.
RACY = ("captured_reused_pinned", "outside_reused_pinned")
#: The variants with a ring of pinned slots, each guarded by an event.
RINGS = ("ring_graphs", "ring_outside")


#: The most bytes of host (and as many of device) memory one staging set-up may hold: ``ring_depth`` x
#: ``tensors`` x ``n_ints`` int32 (the lesson's largest is 3 x 6 x 256 x 4 B = 18 KiB).
MAX_STAGING_BYTES = 1 << 30
#: The most bytes a GPU experiment here may allocate for its tensors (KV cache, outputs, static inputs).
MAX_EXPERIMENT_BYTES = 32 << 30


def _name_of(arg: str, value, known: dict) -> str:
    """``value`` when it is one of ``known``'s keys (a str), else a clear error naming ``arg``."""
    if not isinstance(value, str) or value not in known:
        err = TypeError if not isinstance(value, str) else ValueError
        raise err(f"{arg} must be one of {', '.join(known)}, got {value!r}")
    return value


def _names(arg: str, values, known: dict) -> list[str]:
    """``values`` (None: every key of ``known``) as a list of distinct names of ``known``."""
    if values is None:
        return list(known)
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{arg} must be a list of names such as [{next(iter(known))!r}] or None (all), got "
                        f"{type(values).__name__} ({values!r:.60})")
    names = [_name_of(f"{arg}[{i}]", v, known) for i, v in enumerate(values)]
    if not names:
        raise ValueError(f"{arg} must name at least one of {', '.join(known)} (or be None: all)")
    twice = sorted({v for v in names if names.count(v) > 1})
    if twice:
        raise ValueError(f"{arg} names {twice} more than once: name each once")
    return names


def _variant(value) -> str:
    return _name_of("variant", value, VARIANTS)


def _staging_bytes(tensors: int, n_ints: int, depth: int) -> None:
    nbytes = depth * tensors * n_ints * 4
    if nbytes > MAX_STAGING_BYTES:
        raise ValueError(f"tensors x n_ints x ring_depth x 4 B = {nbytes} B of pinned memory: at most "
                         f"{MAX_STAGING_BYTES} B (1 GiB); use fewer tensors, a smaller n_ints or a shallower ring")


def _stage_parts(variant, s, tensors, n_ints, depth):
    """The host buffers and graphs of one variant: (slots, static, out, graphs).

    ``slots[k]`` is slot k's host memory as ``tensors`` rows of ``n_ints`` int32 (one slab, so a ring copies
    a step's metadata in one copy); ``static`` the graph's static device input (the same shape); ``out`` what
    the graph's kernel writes (static's first column, one value per tensor)."""
    shape = (tensors, n_ints)
    if variant == "snapshot_outside":
        slots = [torch.zeros(shape, dtype=torch.int32)]                           # pageable metadata
    else:
        slots = [torch.zeros(shape, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
    static = torch.zeros(shape, dtype=torch.int32, device=s.device)
    out = torch.zeros(tensors, dtype=torch.int32, device=s.device)
    graphs = []
    for k in range(depth if variant == "ring_graphs" else 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            if variant == "captured_reused_pinned":
                for i in range(tensors):                   # one captured copy per metadata tensor
                    static[i].copy_(slots[k][i], non_blocking=True)
            elif variant == "ring_graphs":
                static.copy_(slots[k], non_blocking=True)  # slot k's whole slab, captured in graph k
            out.copy_(static[:, 0])                        # the step's kernels read the static input
        graphs.append(g)
    return slots, static, out, graphs


def _stage(variant, slot, static, tensors) -> None:
    """Step n's host-to-device copies outside the graph (after the host wrote ``slot``)."""
    if variant == "outside_reused_pinned":
        for i in range(tensors):
            static[i].copy_(slot[i], non_blocking=True)
    elif variant == "snapshot_outside":
        for i in range(tensors):                           # the PR: one snapshot per tensor
            static[i].copy_(slot[i].pin_memory(), non_blocking=True)
    elif variant == "ring_outside":
        static.copy_(slot, non_blocking=True)              # the slab ring: one copy for every tensor


def _step(variant, n, k, parts, events, s, tensors, busy_ms=None) -> None:
    """Step n of ``variant`` in slot k: wait for the copy that last read slot k (a ring), write step n's
    metadata, stage it, keep the GPU ``busy_ms`` behind (None: no busy work), replay, record slot k's event
    (a ring). ``parts`` as :func:`_stage_parts` returns; ``events`` one entry per slot, None until recorded."""
    slots, static, _, graphs = parts
    if events[k] is not None:
        events[k].synchronize()          # the copy that last read slot k has run
    slots[k].fill_(n)                    # the host writes step n's metadata
    _stage(variant, slots[k], static, tensors)
    if busy_ms is not None:
        s.busy(busy_ms)                  # the rest of the previous step keeps the GPU behind
    graphs[k if variant == "ring_graphs" else 0].replay()
    if variant in RINGS:
        if events[k] is None:
            events[k] = s.Event()
        events[k].record()


def graph_loop(variant: str, *, steps: int = 200, tensors: int = 1, n_ints: int = 64, busy_ms: float = 0.1,
               ring_depth: int = 3, stream=None) -> dict:
    """Run ``steps`` decode-like steps whose kernels are one replayed graph, and count what they read.

    Step n writes n into every element of the host metadata (``tensors`` tensors of ``n_ints`` int32), gets it
    into the graph's static device input as ``variant`` says, keeps the GPU ``busy_ms`` behind, replays the
    graph (its kernel copies each static tensor's first value to ``out``) and records ``out`` (a device-to-device
    copy outside the graph). Returns ``received`` (per step, the value each tensor's kernel read, or -1 where
    the tensors disagreed), ``corrupted`` (steps where any tensor read another step's data) and ``emulated``.
    Over many steps the GPU falls behind and the launch queue fills, so the host's time per step here is the
    GPU's pace, not the staging's cost: :func:`staging_cost` measures that."""
    variant = _variant(variant)
    steps = positive_int("steps", steps, maximum=100_000)
    tensors = positive_int("tensors", tensors, maximum=64)
    n_ints = positive_int("n_ints", n_ints, maximum=1 << 20)
    busy_ms = positive_number("busy_ms", busy_ms, allow_zero=True, maximum=1000.0)
    ring_depth = positive_int("ring_depth", ring_depth, maximum=64)
    depth = ring_depth if variant in RINGS else 1
    _staging_bytes(tensors, n_ints, depth)
    s = steploop.cuda_or(stream, "graph_loop()")
    with s:
        parts = _stage_parts(variant, s, tensors, n_ints, depth)
        out = parts[2]
        seen = torch.zeros(steps, tensors, dtype=torch.int32, device=s.device)
        events = [None] * depth
        for n in range(steps):
            _step(variant, n, n % depth, parts, events, s, tensors, busy_ms)
            seen[n].copy_(out)
        s.synchronize()
        rows = seen.tolist()
    received = [r[0] if min(r) == max(r) else -1 for r in rows]
    corrupted = sum(v != n for n, v in enumerate(received))
    return {"variant": variant, "steps": steps, "tensors": tensors, "received": received, "corrupted": corrupted,
            "emulated": bool(s.emulated), "busy_ms": busy_ms}


#: the child :func:`blocking_verdicts` starts (``CUDA_LAUNCH_BLOCKING`` is read when CUDA starts: a fresh process)
VERDICTS_CHILD = ("import sys\nfrom pinlab.child import report_and_exit\n"
                  "from pinlab.lessons.l08_cuda_graphs import verdicts_run\n"
                  "report_and_exit(verdicts_run(int(sys.argv[1])))\n")


def verdicts_run(steps: int) -> dict:
    """The captured copy from one reused pinned buffer (:func:`graph_loop`'s ``captured_reused_pinned``, the GPU
    busy 0.5 ms a step) once under each verdict: :func:`pinlab.races.detect_races` (timing: "has this replay's
    copy run yet?") and :func:`pinlab.detect_races` (order). On CUDA in this process as it is
    (:func:`blocking_verdicts` starts it with ``CUDA_LAUNCH_BLOCKING=1``); without CUDA on the emulated stream at
    lag 0, a GPU that keeps up (:func:`pinlab.order.lagging_stream`). Returns ``steps``, ``stream`` (its label),
    ``launch_blocking``, ``wrong`` (steps that read another step's data, both runs), ``timing`` and ``order``
    (each verdict's findings) and ``raced`` (of the order verdict's, raced in this run)."""
    import os

    from ..order import detect_races, lagging_stream
    from ..races import detect_races as by_timing
    from ..streams import CudaStream

    steps = positive_int("steps", steps, maximum=10_000)
    cuda = torch.cuda.is_available()
    out = {"steps": steps, "launch_blocking": cuda and os.environ.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1",
           "wrong": 0}
    for verdict, detector in (("timing", by_timing), ("order", detect_races)):
        s = CudaStream() if cuda else lagging_stream(0)
        with detector() as races:
            out["wrong"] += graph_loop("captured_reused_pinned", steps=steps, busy_ms=0.5, stream=s)["corrupted"]
        out["stream"] = s.label if not s.emulated else "emulated stream at lag 0 (a GPU that keeps up)"
        out[verdict] = races.total
        if verdict == "order":
            out["raced"] = sum(races.in_run.values())
    return out


def blocking_verdicts(steps: int = 50, timeout_s: float = 120.0) -> dict:
    """:func:`verdicts_run` in a fresh process with ``CUDA_LAUNCH_BLOCKING=1`` (:data:`VERDICTS_CHILD`): the order
    verdict turns torch's GPU trace on for good, so it runs away from this notebook's later timings. Raises
    RuntimeError, saying what went wrong, where the child gives no result."""
    import os

    from ..child import run_child

    steps, timeout_s = positive_int("steps", steps, maximum=10_000), positive_number("timeout_s", timeout_s)
    res = run_child(VERDICTS_CHILD, (steps,), env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"), timeout_s=timeout_s)
    if "error" in res:
        raise RuntimeError(f"l08.blocking_verdicts: {res['error']}")
    return res


def staging_cost(variants=None, *, tensors: int = 6, n_ints: int = 256, rounds: int = 10, steps: int = 50,
                 busy_ms: float = 0.0, ring_depth: int = 3) -> dict:
    """Host µs per step of each variant's staging (metadata write, copies, replay call), CUDA only.

    ``rounds`` interleaved rounds (every variant once per round, the order rotating each round:
    :func:`pinlab.timing.interleaved`) of ``steps`` steps each, with a
    synchronize after every round: the launch queue never fills, so the time is the host's own cost. Keep
    ``busy_ms`` below the host's time per step: a GPU slower than the host makes the rings wait for their
    events, and their time is then the GPU's pace (on the H200, 0.05 ms made both rings cost 50 µs, the busy
    time, against 12 µs for the racy captured copy). Returns rows {variant, host_us (median of the rounds'
    medians), round_medians_us}."""

    names = _names("variants", variants, VARIANTS)
    tensors = positive_int("tensors", tensors, maximum=64)
    n_ints = positive_int("n_ints", n_ints, maximum=1 << 20)
    rounds = positive_int("rounds", rounds, maximum=1000)
    steps = positive_int("steps", steps, maximum=200)
    busy_ms = positive_number("busy_ms", busy_ms, allow_zero=True, maximum=100.0)
    ring_depth = positive_int("ring_depth", ring_depth, maximum=64)
    _staging_bytes(tensors, n_ints, ring_depth * len(names))
    require_cuda("staging_cost()")
    s = steploop.cuda_or(None, "staging_cost()")
    with s:
        depths = {v: ring_depth if v in RINGS else 1 for v in names}
        parts = {v: _stage_parts(v, s, tensors, n_ints, depths[v]) for v in names}

        def one_round(v, _r):
            events = [None] * depths[v]
            ns = []
            for n in range(steps):
                t0 = time.perf_counter_ns()
                _step(v, n, n % depths[v], parts[v], events, s, tensors)
                ns.append(time.perf_counter_ns() - t0)
                if busy_ms:
                    s.busy(busy_ms)
            s.synchronize()
            return statistics.median(ns) / 1e3

        medians = interleaved(names, rounds, one_round)  # the order rotates each round
    rows = [{"variant": v, "host_us": statistics.median(m), "round_medians_us": m} for v, m in medians.items()]
    return {"tensors": tensors, "n_ints": n_ints, "rounds": rounds, "steps": steps, "busy_ms": busy_ms,
            "rows": rows}


def every_variant(variants=None, *, steps: int = 200, tensors: int = 1, n_ints: int = 64, busy_ms: float = 0.1,
                  ring_depth: int = 3, stream=None) -> dict:
    """:func:`graph_loop` for each of ``variants`` (default: all; each named once), the same loop and arguments."""
    names = _names("variants", variants, VARIANTS)
    runs = {v: graph_loop(v, steps=steps, tensors=tensors, n_ints=n_ints, busy_ms=busy_ms, ring_depth=ring_depth,
                          stream=stream) for v in names}
    return {"steps": steps, "busy_ms": busy_ms,
            "tensors": tensors,
            "rows": [{k: r[k] for k in ("variant", "corrupted", "emulated")} for r in runs.values()],
            "received": {v: r["received"] for v, r in runs.items()}}


def host_cost(kernels=(1, 5, 10, 20, 40), *, repeat: int = 200, numel: int = 256) -> dict:
    """Host µs per step: ``k`` small kernels launched eagerly against one ``g.replay()`` of the same ``k``
    kernels captured in a graph (CUDA only). Returns rows {kernels, eager_us, replay_us} (medians)."""

    counts = _counts("kernels", kernels, 1000, "kernels per step")
    repeat = positive_int("repeat", repeat, maximum=100_000)
    numel = positive_int("numel", numel, maximum=1 << 24)
    require_cuda("host_cost()")
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


# ---- real paged decode under graph replay (FlashInfer) ------------------------------------------------------

#: How a graph-mode decode step hands its host metadata (indptr, last_page_len) to FlashInfer's ``plan()``,
#: which copies it into the wrapper's fixed device buffers with ``non_blocking=True``.
FLASHINFER_VARIANTS = {
    "reused_pinned": "one pinned indptr and one pinned last_page_len buffer, rewritten by the host every step",
    "snapshot": "the PR (vLLM 0.29): pageable metadata, a pin_memory() snapshot of each tensor per plan()",
    "pinned_ring": "a pinned buffer pair per wrapper of the ring, rewritten only after that wrapper's last "
                   "step has run (its event)",
}


def _counts(name: str, values, maximum: int, what: str) -> list[int]:
    """A non-empty list of ints from 1 to ``maximum`` (``what`` each counts), or a clear error naming ``name``."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of ints ({what}), got {type(values).__name__}")
    out = [positive_int(f"{name}[{i}]", v, maximum=maximum) for i, v in enumerate(values)]
    if not out:
        raise ValueError(f"{name} must not be empty: give at least one count of {what}")
    return out


def decode_metadata(n: int, batch: int, max_pages: int, page_size: int) -> tuple[list[int], list[int]]:
    """Step ``n``'s metadata for the graph decode: every request has ``w = 1 + n % max_pages`` pages (so
    consecutive steps differ), and its last page holds ``1 + (5n + 3i) % page_size`` tokens. Returns
    ``(indptr, last_page_len)`` as lists (indptr = 0, w, 2w, ...)."""
    n = positive_int("n", n, allow_zero=True)
    batch = positive_int("batch", batch, maximum=1 << 16)
    max_pages = positive_int("max_pages", max_pages, maximum=1 << 20)
    page_size = positive_int("page_size", page_size, maximum=1 << 16)
    if batch * max_pages > INT32_MAX:
        raise ValueError(f"batch x max_pages = {batch * max_pages} pages: indptr is int32, at most {INT32_MAX}")
    w = 1 + n % max_pages
    return [i * w for i in range(batch + 1)], [1 + (5 * n + 3 * i) % page_size for i in range(batch)]


def _decode_loop_args(ring, busy_ms, tol, seed) -> tuple:
    """The graph decode loop's own arguments, checked (each error names its argument)."""
    return (positive_int("ring", ring, maximum=16),
            positive_number("busy_ms", busy_ms, allow_zero=True, maximum=100.0),
            positive_number("tol", tol), positive_int("seed", seed, allow_zero=True))


def flashinfer_graph_decode(variant: str, *, steps: int = 200, batch: int = 8, max_pages: int = 8,
                            page_size: int = 16, num_qo_heads: int = 32, num_kv_heads: int = 8,
                            head_dim: int = 128, ring: int = 3, busy_ms: float = 0.5, tol: float = 0.02,
                            seed: int = 0) -> dict:
    """Paged decode through FlashInfer's CUDA-graph wrappers, ``steps`` steps (CUDA and FlashInfer only).

    A ring of ``ring`` wrappers (:class:`pinlab.paged_kv.FlashInferDecode` in graph mode), each with its
    own fixed device buffers and its own captured ``run()``. Step n: wait for the event of step n - ring
    (the wrapper's previous step has run: FlashInfer's own pinned workspace is then free), write step n's
    metadata (:func:`decode_metadata`) as ``variant`` says (:data:`FLASHINFER_VARIANTS`), ``plan()`` outside
    the graph, keep the GPU ``busy_ms`` behind, replay, keep the output. Every step's output is compared with
    :func:`pinlab.paged_kv.reference_decode` fed with step n's correct metadata. Returns ``wrong_steps``
    (steps with a request more than ``tol`` off), ``steps`` and ``max_err`` per step."""
    from ..paged_kv import FlashInferDecode, reference_decode

    variant = _name_of("variant", variant, FLASHINFER_VARIANTS)
    steps = positive_int("steps", steps, maximum=100_000)
    batch = positive_int("batch", batch, maximum=256)
    max_pages = positive_int("max_pages", max_pages, maximum=1024)
    page_size = positive_int("page_size", page_size, maximum=256)
    num_qo_heads = positive_int("num_qo_heads", num_qo_heads, maximum=256)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads, maximum=256)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    head_dim = positive_int("head_dim", head_dim, maximum=1024)
    ring, busy_ms, tol, seed = _decode_loop_args(ring, busy_ms, tol, seed)
    kv_bytes = 2 * (batch * max_pages + 4) * page_size * num_kv_heads * head_dim * 2
    out_bytes = steps * batch * num_qo_heads * head_dim * 2
    if kv_bytes + out_bytes > MAX_EXPERIMENT_BYTES:
        raise ValueError(f"the KV cache ({kv_bytes} B: batch, max_pages, page_size, num_kv_heads, head_dim) and the "
                         f"outputs kept ({out_bytes} B: steps, batch, num_qo_heads, head_dim) would need more than "
                         f"{MAX_EXPERIMENT_BYTES >> 30} GiB of GPU memory: use fewer steps or a smaller batch")
    require_cuda("flashinfer_graph_decode()")
    s = steploop.cuda_or(None, "flashinfer_graph_decode()")
    g = torch.Generator().manual_seed(int(seed))
    pool = batch * max_pages + 4
    k_cache = torch.randn((pool, page_size, num_kv_heads, head_dim), generator=g).half().cuda()
    v_cache = torch.randn((pool, page_size, num_kv_heads, head_dim), generator=g).half().cuda()
    q = torch.randn((batch, num_qo_heads, head_dim), generator=g).half().cuda()
    block_table = torch.randperm(pool, generator=g)[: batch * max_pages].reshape(batch, max_pages).int().cuda()
    wrappers = [FlashInferDecode(num_qo_heads, num_kv_heads, head_dim, page_size, graph_batch=batch,
                                 graph_max_pages=batch * max_pages) for _ in range(ring)]
    pinned = variant != "snapshot"
    slots = [(torch.zeros(batch + 1, dtype=torch.int32, pin_memory=pinned),
              torch.zeros(batch, dtype=torch.int32, pin_memory=pinned))
             for _ in range(ring if variant == "pinned_ring" else 1)]
    outs = torch.zeros((steps, batch, num_qo_heads, head_dim), dtype=torch.float16, device="cuda")
    graphs, graph_out = [], []
    with s:
        for w in wrappers:                                   # capture run() once per wrapper
            ip, lpl = decode_metadata(0, batch, max_pages, page_size)
            w.plan(torch.tensor(ip, dtype=torch.int32), block_table.reshape(-1),
                   torch.tensor(lpl, dtype=torch.int32))
            w.run(q, k_cache, v_cache)                       # warm-up (JIT), outside the capture
            s.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_out.append(w.run(q, k_cache, v_cache))
            graphs.append(graph)
        s.synchronize()
        events = [None] * ring
        for n in range(steps):
            k = n % ring
            if events[k] is not None:
                events[k].synchronize()          # wrapper k's last step has run
            ip, lpl = decode_metadata(n, batch, max_pages, page_size)
            indptr, last = slots[k % len(slots)]
            indptr.copy_(torch.tensor(ip, dtype=torch.int32))     # the host writes step n's metadata
            last.copy_(torch.tensor(lpl, dtype=torch.int32))
            indices = block_table[:, : ip[1]].reshape(-1)          # built on the device: stream-ordered
            if variant == "snapshot":
                wrappers[k].plan(indptr.pin_memory(), indices, last.pin_memory())
            else:
                wrappers[k].plan(indptr, indices, last)
            s.busy(busy_ms)                      # the GPU is behind the host
            graphs[k].replay()
            outs[n].copy_(graph_out[k])
            if events[k] is None:
                events[k] = s.Event()
            events[k].record()
        s.synchronize()
    errs = []
    for n in range(steps):
        ip, lpl = decode_metadata(n, batch, max_pages, page_size)
        indices = block_table[:, : ip[1]].reshape(-1)
        ref = reference_decode(q, k_cache, v_cache, torch.tensor(ip, dtype=torch.int32), indices,
                               torch.tensor(lpl, dtype=torch.int32))
        errs.append(float((outs[n].float() - ref).abs().max()))
    wrong = sum(1 for e in errs if not e <= tol)             # NaN counts as wrong
    del wrappers, graphs, graph_out
    return {"variant": variant, "steps": steps, "wrong_steps": wrong, "max_err": errs, "busy_ms": busy_ms,
            "ring": ring, "tol": tol}


def flashinfer_graph_runs(variants=None, *, steps: int = 200, ring: int = 3, busy_ms: float = 0.5,
                          tol: float = 0.02, seed: int = 0) -> dict:
    """:func:`flashinfer_graph_decode` for each of ``variants`` (default: all of :data:`FLASHINFER_VARIANTS`),
    summarised for a recording (CUDA only). Returns ``{"flashinfer": bool, "reason", "steps", "ring",
    "busy_ms", "tol", "rows"}``; each row {variant, wrong_steps, first_wrong (a step, or -1), max_err (over
    all steps), max_err_right (over the steps within ``tol``, -1 where none was), seconds (the first run
    includes FlashInfer's JIT build or cache load)}. Where FlashInfer cannot run here (not installed, its
    build failed), ``flashinfer`` is False, ``reason`` says why in one sentence and ``rows`` is empty."""
    from ..paged_kv import FlashInferUnavailableError

    names = _names("variants", variants, FLASHINFER_VARIANTS)
    steps = positive_int("steps", steps, maximum=100_000)
    ring, busy_ms, tol, seed = _decode_loop_args(ring, busy_ms, tol, seed)
    require_cuda("flashinfer_graph_runs()")
    out = {"flashinfer": True, "reason": "", "steps": steps, "ring": ring, "busy_ms": busy_ms, "tol": tol,
           "rows": []}
    for v in names:
        t0 = time.perf_counter()
        try:
            run = flashinfer_graph_decode(v, steps=steps, ring=ring, busy_ms=busy_ms, tol=tol, seed=seed)
        except FlashInferUnavailableError as exc:
            return {**out, "flashinfer": False, "reason": " ".join(str(exc).split())[:300], "rows": []}
        errs = run["max_err"]
        wrong = [n for n, e in enumerate(errs) if not e <= tol]
        right = [e for e in errs if e <= tol]
        out["rows"].append({"variant": v, "wrong_steps": run["wrong_steps"], "first_wrong": wrong[0] if wrong else -1,
                            "max_err": max((e for e in errs if e == e), default=-1.0),
                            "max_err_right": max(right, default=-1.0),
                            "seconds": round(time.perf_counter() - t0, 2)})
    return out


def graph_memory(batch_sizes=(1, 8, 64, 256), *, hidden: int = 4096, layers: int = 4, ring_depth: int = 3,
                 tensors: int = 6, n_ints: int = 256) -> dict:
    """What graphs hold in memory, CUDA only.

    For each batch size (an engine captures one graph per size), a static input ``[batch, hidden]`` fp32
    and a graph of ``layers`` elementwise steps on it (each makes an intermediate tensor, as a layer's
    activations do). Rows {batch, static_bytes (the static input, by ``memory_allocated``),
    graph_allocated_bytes (what the captured graph keeps allocated: its output, from its private pool),
    graph_reserved_bytes (how much ``memory_reserved`` grew at the capture: the pool's segments),
    activation_bytes (one intermediate's size)}. Then the pinned bytes a staging ring of ``ring_depth``
    slabs of ``tensors`` x ``n_ints`` int32 holds (``ring_pinned_bytes``, from the caching host allocator's
    statistics, against ``ring_requested_bytes``). Everything is freed before it returns."""
    from ..hostmem import pinned_bytes_held, release_cached_host_blocks

    sizes = _counts("batch_sizes", batch_sizes, 65536, "sequences per batch")
    hidden = positive_int("hidden", hidden, maximum=1 << 16)
    layers = positive_int("layers", layers, maximum=64)
    graph_bytes = sum(sizes) * hidden * 4 * 2          # each static input and its graph's output, kept
    if graph_bytes > MAX_EXPERIMENT_BYTES:
        raise ValueError(f"batch_sizes x hidden x 8 B = {graph_bytes} B of GPU memory kept at once: at most "
                         f"{MAX_EXPERIMENT_BYTES >> 30} GiB; use smaller batch_sizes or hidden")
    ring_depth = positive_int("ring_depth", ring_depth, maximum=64)
    tensors = positive_int("tensors", tensors, maximum=64)
    n_ints = positive_int("n_ints", n_ints, maximum=1 << 20)
    _staging_bytes(tensors, n_ints, ring_depth)
    require_cuda("graph_memory()")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start_allocated, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    keep, rows = [], []
    for b in sizes:
        a0 = torch.cuda.memory_allocated()
        static = torch.zeros(b, hidden, device="cuda")
        a1 = torch.cuda.memory_allocated()

        def step(static=static):
            y = static
            for _ in range(layers):
                y = y * 1.0001 + 1.0                   # each layer makes an intermediate, as activations do
            return y

        step()                                         # warm-up, eagerly (loads the kernels)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()                       # as torch.cuda.graph() does on entry: r2 is what stays
        a2, r2 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        torch.cuda.synchronize()
        a3, r3 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        keep.append((g, static, out))
        rows.append({"batch": b, "static_bytes": a1 - a0, "graph_allocated_bytes": a3 - a2,
                     "graph_reserved_bytes": r3 - r2, "activation_bytes": b * hidden * 4})
    held_allocated = torch.cuda.memory_allocated() - start_allocated
    held_reserved = torch.cuda.memory_reserved() - start_reserved
    del keep, g, static, out, step
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    release_cached_host_blocks()
    p0 = pinned_bytes_held()
    slots = [torch.zeros((tensors, n_ints), dtype=torch.int32, pin_memory=True) for _ in range(ring_depth)]
    ring_pinned = pinned_bytes_held() - p0
    del slots
    release_cached_host_blocks()
    return {"hidden": hidden, "layers": layers, "rows": rows, "held_allocated_bytes": held_allocated,
            "held_reserved_bytes": held_reserved, "ring_depth": ring_depth,
            "ring_requested_bytes": ring_depth * tensors * n_ints * 4, "ring_pinned_bytes": ring_pinned}


# ---------------------------------------------------------------------------------------------
# the notebook's tables, a printed sentence, and its reasons
# ---------------------------------------------------------------------------------------------

def _us(v):
    return f"{v:.1f}"


def _kib(v):
    return f"{v / 1024:.0f}"


#: columns of the notebook's tables: :func:`host_cost`, :func:`staging_cost` and :func:`graph_memory` rows
HOST_COST_COLUMNS = [("kernels", "kernels"), ("eager_us", "eager µs", _us), ("replay_us", "replay µs", _us)]
STAGING_COLUMNS = [("variant", "variant"), ("host_us", "host µs per step", _us)]
MEMORY_COLUMNS = [("batch", "batch"), ("activation_bytes", "one activation KiB", _kib),
                  ("static_bytes", "static input KiB", _kib),
                  ("graph_allocated_bytes", "graph keeps allocated KiB", _kib),
                  ("graph_reserved_bytes", "capture reserved KiB", _kib)]


def refusals_left_text(left: int) -> str:
    """What the pinned bytes the refused captures left in use are (the notebook's ``what that is`` line)."""
    if not left:
        return "nothing: the refused captures left no pinned memory in use"
    return (f"{left} bytes, the size of the value `.item()` copies to the host: torch stages that copy in pinned "
            "memory, and the aborted capture did not release that block: this process can no longer free it (the "
            "last cell of this lesson allows for it)")


#: why a claim (or an observed line) of the notebook may not hold on some machine (``why=l08.WHY.name``)
WHY = Reasons(
    host_times="host timings: a slow or shared CPU makes both dearer, and a replay's fixed cost weighs more against "
               "few kernels",
    capture_rules="torch checks that a copy's CPU side is pinned before a capture records it (Copy.cu, pytorch PR "
                  "#172156), and CUDA refuses a wait while a stream captures; a different outcome means a different "
                  "torch or CUDA version: see its release notes",
    lead="the race needs the GPU behind the host: 0.5 ms of GPU work per step against a host step of microseconds; "
         "a host slower than that (a CPU shared by many processes) lets it keep up",
    detector="the race needs the GPU behind the host (0.5 ms per step); a replay reads wrong data only if the host "
             "rewrote its source while it was pending, which the detector asks before every write",
    own_memory="each fix gives every step its own pinned memory until its copy has run; a corrupted step is a bug",
    lead_01="the GPU's lead: 0.1 ms per step against the host's µs; a shared GPU or a slow host lets a few copies "
            "run before the next write",
    ring_cost="a ring waits for the event of its slot's last copy: on a GPU busy with other processes' work those "
              "events come late and the ring pays the GPU's pace; and host timings (the allocator's cost per "
              "snapshot, the launch cost of the copies) differ between hosts",
    fi_fixes="each plan() reads memory nobody rewrites before its copies have run, and every wrapper waits for its "
             "previous step; a wrong step is a bug (or a broken FlashInfer build)",
    fi_race="the race needs the GPU behind the host: 0.5 ms of GPU work per step against a host step (metadata, "
            "plan(), replay) well under that; a host slower than the GPU (a CPU shared by many processes) lets "
            "every copy run before the next write",
    fi_most="a race: the first steps run before the GPU falls behind, and a slow or shared host lets more copies "
            "run before the next write",
    test_lead="the test keeps the GPU 50 ms behind a host that needs microseconds per step; a host slower than that "
              "would let a racy copy run in time",
    few_us="host timings of a few µs: a shared or slow CPU adds noise of that size",
    launch_blocking="with CUDA_LAUNCH_BLOCKING=1 every replay has run before replay() returns, on any CUDA GPU (and "
                    "on the emulated stream at lag 0): a wrong step or a timing finding means the variable did not "
                    "reach the child's CUDA, or a bug in pinlab.races",
    by_order="the order verdict counts every captured copy whose source the host rewrote before anything ordered "
             "it, whatever the GPU's speed; another count than the notebook's is a bug in pinlab.order",
    pool="the caching allocator's segment sizes (2 MiB for small blocks by default) and PYTORCH_CUDA_ALLOC_CONF "
         "settings such as expandable_segments decide how much a pool reserves",
)
