"""Lesson 03, the race: its experiments and plots.

The notebook writes the step loop itself and runs it live (GPU) or on the emulated lagging
stream (CPU). The experiments here are that loop for every strategy, measured on the GPU:

* :func:`plain_race`: the plain step loop (:mod:`pinlab.steploop`) with a reused pinned and a
  pageable buffer;
* :func:`pageable_cost`: what the pageable buffer (#32799) costs the host at several sizes;
* :func:`decode_race`: the paged-decode loop (:mod:`pinlab.decode_loop`) with real attention.

Each takes ``stream=None``: None means the CUDA stream (CudaUnavailableError without CUDA); a
:class:`pinlab.LaggingStream` runs the same code on the CPU.
"""
from __future__ import annotations

import numpy as np

from .. import decode_loop, steploop
from ..args import positive_int, positive_number
from ..steploop import KiB, LABELS, MiB

__all__ = ["plain_race", "pageable_cost", "decode_race", "plot_received", "plot_errors", "plot_host_cumulative"]


def plain_race(strategies=("reused_pinned", "pageable"), steps: int = 200, nbytes: int = 256,
               busy_ms: float = 0.5, ahead: int | None = None, ring_depth: int = 3, stream=None) -> dict:
    """The plain step loop, once per strategy.

    Each step writes its step number into every int32 of an ``nbytes`` host buffer, copies it
    with ``non_blocking=True`` into a device slot, and keeps the GPU busy for ``busy_ms`` (the
    step's forward). ``ahead=None``: the host never waits (MRV2 with no sync between steps);
    an int: the host waits for step n-ahead before building step n (a batch queue).

    Returns ``{"steps", "nbytes", "busy_ms", "ahead", "runs": {strategy: run}}``; each run has
    ``received`` (the step each copy delivered, -1 for a torn row), ``corrupted``, ``torn``,
    ``host`` (µs per step inside write+stage+copy: median, mean, p90, max), ``host_us`` per step,
    ``host_loop_ms``, ``drain_ms`` (how long the final sync waited) and ``pinned_bytes_held``.
    """
    args = dict(strategies=steploop.strategies_arg(strategies), steps=positive_int("steps", steps),
                nbytes=nbytes, busy_ms=positive_number("busy_ms", busy_ms), ahead=steploop.ahead_arg(ahead),
                ring_depth=positive_int("ring_depth", ring_depth))
    steploop.ints_in("nbytes", nbytes)
    stream = steploop.cuda_or(stream, "plain_race()")
    return steploop.every_strategy(stream, **args)


def pageable_cost(sizes=(KiB, 64 * KiB, MiB, 4 * MiB), steps: int = 400, busy_ms: float = 0.5, stream=None) -> dict:
    """The pageable buffer (#32799) in the unbounded step loop, at several metadata sizes.

    Returns ``{"sizes", "steps", "busy_ms", "runs": [run per size]}``; each run as in
    :func:`plain_race` (without ``received``): correct data, but the host time per step shows
    when the driver's staging makes the host wait for the GPU.
    """
    sizes = steploop.sizes_arg(sizes)
    steps = positive_int("steps", steps)
    busy_ms = positive_number("busy_ms", busy_ms)
    steploop.check_dst(steps, max(sizes) // 4)
    stream = steploop.cuda_or(stream, "pageable_cost()")
    runs = []
    for s in sizes:
        n_ints = s // 4
        steploop.warm(stream, ["pageable"], n_ints, busy_ms, None, 1)
        run = steploop.plain_loop(stream, "pageable", steps=steps, n_ints=n_ints, busy_ms=busy_ms, ahead=None)
        run.pop("received")
        runs.append(run)
    return {"sizes": sizes, "steps": steps, "busy_ms": busy_ms, "runs": runs}


def decode_race(strategies=("reused_pinned", "pageable"), steps: int = 64, max_batch: int = 16,
                page_size: int = 16, max_seq_len: int = 256, num_qo_heads: int = 8, num_kv_heads: int = 2,
                head_dim: int = 128, busy_ms: float = 1.0, ring: int = 3, ahead: int = 2, seed: int = 0,
                backend: str = "auto", tol: float = 0.02, stream=None) -> dict:
    """A vLLM-shaped decode loop with real paged attention, once per strategy (:mod:`pinlab.decode_loop`).

    Requests grow by one token a step, join and leave (:func:`pinlab.decode_loop.decode_schedule`).
    Each step the host writes indptr and last_page_len into the metadata buffer and copies it to
    the GPU with ``non_blocking=True``; the page indices are built **on the GPU** from that GPU
    copy of indptr and the block table; FlashInfer's ``plan()`` gets host indptr/last_page_len and
    the GPU indices, as in vLLM. A ring of ``ring`` :class:`~pinlab.paged_kv.FlashInferDecode`
    wrappers is used in turn and the host waits for step n-``ahead`` before building step n
    (``ahead <= ring``: never re-plan a wrapper whose last plan may not have run, which crashes
    the CUDA context). ``backend="auto"`` falls back to
    :func:`~pinlab.decode_loop.torch_paged_decode` (fed by the GPU copies of both arrays) when
    FlashInfer cannot run (always on the emulated stream); the result says which ran and why.

    Returns per strategy: ``received`` (the step whose metadata each copy delivered), counts of
    wrong copies, of steps/requests that attended wrong pages and of steps with an output off by
    more than ``tol`` from :func:`pinlab.paged_kv.reference_decode`, the per-request ``err``
    and ``wrong_inputs`` matrices (ragged: one row per step), and host µs per step.
    """
    args = decode_loop.check_args(strategies=strategies, steps=steps, max_batch=max_batch, page_size=page_size,
                                  max_seq_len=max_seq_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, busy_ms=busy_ms, ring=ring, ahead=ahead, seed=seed,
                                  backend=backend, tol=tol)
    stream = steploop.cuda_or(stream, "decode_race()")
    return decode_loop.every_strategy(stream, **args)


# =============================================================================================
# Plots (computed from recorded results, identical live and replayed)
# =============================================================================================

def plot_received(runs: dict, *, title: str, ax=None):
    """x: the step, y: the step whose data its copy delivered (-1: a mix); the diagonal is correct."""
    import matplotlib.pyplot as plt

    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a non-empty dict {strategy: run with 'received'}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    markers = "oxs^v+"
    for i, (name, run) in enumerate(runs.items()):
        rec = run["received"]
        ax.plot(range(len(rec)), [r if r is not None else float("nan") for r in rec], markers[i % len(markers)],
                ms=3, alpha=0.7, label=f"{LABELS.get(name, name)}: {run['corrupted']} wrong")
    n = max(len(r["received"]) for r in runs.values())
    ax.plot([0, n - 1], [0, n - 1], "k--", lw=0.8, label="correct (its own step)")
    ax.set_xlabel("step n")
    ax.set_ylabel("step whose data copy n delivered")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_errors(result: dict, strategy: str, *, title: str, ax=None):
    """Heatmap of a decode run's per-request max error (log10), steps down, batch slots across;
    a dot marks a request whose attention read wrong inputs."""
    import matplotlib.pyplot as plt

    run = result["runs"][strategy]
    m = decode_loop.error_matrix(run, result["max_batch"])
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 5))
    with np.errstate(divide="ignore", invalid="ignore"):
        img = ax.imshow(np.log10(np.maximum(m, 1e-7)), aspect="auto", cmap="viridis", vmin=-6, vmax=1,
                        interpolation="nearest")
    ys, xs = [], []
    for n, row in enumerate(run["wrong_inputs"]):
        for b, w in enumerate(row):
            if w:
                ys.append(n)
                xs.append(b)
    if xs:
        ax.plot(xs, ys, "r.", ms=4, label="read wrong pages / metadata")
        ax.legend(loc="lower right", fontsize=8)
    ax.figure.colorbar(img, ax=ax, label="log10 max |output - reference|")
    ax.set_xlabel("request (position in the batch)")
    ax.set_ylabel("step")
    ax.set_title(title)
    return ax


def plot_host_cumulative(result: dict, *, title: str, ax=None):
    """Cumulative host ms inside the copy section against the step, one line per metadata size,
    and the GPU's pace (busy_ms per step) for comparison."""
    import matplotlib.pyplot as plt

    from ..plots import fmt_bytes

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"]:
        cum = np.cumsum(run["host_us"]) / 1e3
        ax.plot(range(1, len(cum) + 1), cum, label=f"pageable, {fmt_bytes(run['nbytes'])} per step")
    steps = result["steps"]
    ax.plot([1, steps], [result["busy_ms"], steps * result["busy_ms"]], "k--", lw=0.8,
            label=f"the GPU's pace ({result['busy_ms']} ms per step)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("host ms spent in copy calls (cumulative)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


