"""Lesson 05's library: restoring offloaded weights straight into pinned memory.

The lesson's key code, the three ways to restore a weight to the host (``.to("cpu")``,
``.to("cpu").pin_memory()``, ``torch.empty_like(..., pin_memory=True).copy_()``), the
``device_loading_context``, the sleep and wake of a model and the zero-copy view, is defined in
``notebooks/src/05_pinned_weight_restore.py`` and handed to the harnesses here. What stays here:

* the model the lesson restores (a Llama-shaped MLP of bf16 ``Linear`` layers, no bias), sized
  from a byte budget;
* argument checks with clear errors (:func:`check_restore_args`);
* :func:`count_copies`, which counts the copies a restore makes (works on CUDA and on the
  emulated :class:`pinlab.LaggingStream`);
* the reference answer :func:`pinned_footprint` (the exercise checker imports it);
* the GPU harnesses, one loop for every restore method: :func:`time_restores`,
  :func:`d2h_copy_loop_peak`, :func:`sleep_wake_sweep`, :func:`zero_copy_matmul`.
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..args import bool_arg, callable_arg, positive_int, positive_number, size_list
from ..busy import gpu_busy, warmup
from ..claims import Reasons
from ..device import require_cuda
from ..hostmem import host_stats, next_pow2, pinned_bytes_held, release_cached_host_blocks
from ..progress import progress
from ..timing import cuda_time, fmt_ms

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: The restore benchmark's model: two Llama-2-7B-shaped MLP blocks (hidden 4096, intermediate
#: 11008), four bf16 matrices of 86 MiB each: 344 MiB, and no size a power of two.
HIDDEN, INTER, BLOCKS = 4096, 11008, 2
#: The sleep/wake sweep: target model sizes (the real sizes come out a little larger).
SLEEP_SIZES = [64 * MiB, 256 * MiB, 1 * GiB, 3 * GiB]
BUSY_MS = 20.0
#: The largest model :func:`make_model` builds: 64 GiB of weights (the sweep's largest is about 3 GiB),
#: and at most 256 blocks (the lesson uses 2). Beyond that is a typo, not a lesson.
MAX_MODEL_BYTES = 64 * GiB
MAX_BLOCKS = 256

#: The aten ops that copy a tensor's data (what :func:`count_copies` counts).
COPY_OPS = frozenset({"copy_", "_to_copy", "_pin_memory", "pin_memory", "clone", "_copy_from",
                      "_copy_from_and_resize", "lift_fresh_copy"})


# ---- the model ---------------------------------------------------------------------------------

def mlp_shape_for(total_bytes: int, blocks: int = BLOCKS) -> tuple[int, int]:
    """(hidden, intermediate) of a Llama-shaped MLP (intermediate = 43/16 of hidden, hidden a
    multiple of 256) whose ``blocks`` blocks of bf16 weights come closest to ``total_bytes``."""
    total_bytes = positive_int("total_bytes", total_bytes)
    blocks = positive_int("blocks", blocks)
    # one block: up (inter x hidden) and down (hidden x inter), 2 bytes each: 2 * 2 * 43/16 * h^2
    h = math.sqrt(total_bytes / (blocks * 4 * 43 / 16))
    hidden = max(256, int(round(h / 256)) * 256)
    return hidden, hidden * 43 // 16


def make_model(hidden: int = HIDDEN, inter: int = INTER, blocks: int = BLOCKS, *, device=None,
               dtype=torch.bfloat16, seed: int = 0) -> nn.Sequential:
    """``blocks`` MLP blocks (``Linear(hidden, inter)``, ``Linear(inter, hidden)``, no bias) with
    random weights drawn on ``device`` (reproducible from ``seed``)."""
    hidden = positive_int("hidden", hidden)
    inter = positive_int("inter", inter)
    blocks = positive_int("blocks", blocks, maximum=MAX_BLOCKS)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {type(dtype).__name__}")
    nbytes = 2 * blocks * hidden * inter * dtype.itemsize
    if nbytes > MAX_MODEL_BYTES:
        raise ValueError(f"hidden={hidden}, inter={inter}, blocks={blocks} would make {nbytes / GiB:.3g} GiB of "
                         f"weights: at most MAX_MODEL_BYTES = {MAX_MODEL_BYTES // GiB} GiB")
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(hidden, inter, bias=False, device="meta", dtype=dtype),
                   nn.Linear(inter, hidden, bias=False, device="meta", dtype=dtype)]
    model = nn.Sequential(*layers)
    gen = torch.Generator(device=device if device is not None else "cpu").manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            # no device argument for a host model: under a LaggingStream an explicit device means "the GPU"
            w = (torch.empty(layer.weight.shape, dtype=dtype, device=device) if device is not None
                 else torch.empty(layer.weight.shape, dtype=dtype))
            layer.weight = nn.Parameter(w.normal_(0.0, 0.02, generator=gen))
    return model


def param_bytes(module) -> list[int]:
    """Bytes of each parameter of ``module``, in ``module.parameters()`` order."""
    check_restore_args(module)
    return [p.numel() * p.element_size() for p in module.parameters()]


# ---- argument checks ---------------------------------------------------------------------------

def check_restore_args(module, target_device=None, *, pin: bool = False):
    """Check what a restore is given; return ``torch.device(target_device)`` (or None).

    * ``module`` must be a ``torch.nn.Module`` (TypeError);
    * its parameters must hold data: parameters on the ``meta`` device have none to restore
      (ValueError, naming the first);
    * ``target_device`` must name a device that exists here: ``cuda`` needs CUDA
      (:class:`pinlab.CudaUnavailableError`), ``cuda:N`` needs N < the number of GPUs (ValueError),
      and a misspelt name is a ValueError;
    * ``pin=True`` (a restore into pinned memory) needs page-locked memory: a CUDA GPU, or the
      emulated one of a :class:`pinlab.LaggingStream` (a ValueError naming ``pin`` otherwise).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}: "
                        "restore works on a model's parameters (module.parameters())")
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device: it has a shape but no data, "
                             "so there is nothing to restore (load the weights first, e.g. to_empty() + load_state_dict())")
    bool_arg("pin", pin)
    if target_device is None:
        _check_pin(pin)
        return None
    try:  # a torch.device comes back as it is (a LaggingStream knows its own s.device by identity)
        device = target_device if isinstance(target_device, torch.device) else torch.device(target_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"target_device {target_device!r} is not a device name "
                         f"(try 'cuda', 'cuda:0' or 'cpu'): {exc}") from None
    if device.type == "cuda":
        from ..device import has_cuda

        count = torch.cuda.device_count() if has_cuda() else 0
        if device.index is not None and device.index >= max(count, 1):
            raise ValueError(f"target_device {str(device)!r} does not exist: this machine has {count} "
                             f"CUDA device(s) (valid: {', '.join(f'cuda:{i}' for i in range(count)) or 'none'})")
        require_cuda(f"restoring to {str(device)!r}")
    elif device.type not in ("cpu",):
        raise ValueError(f"target_device {str(device)!r}: this lesson restores to 'cuda' or 'cpu'")
    _check_pin(pin)
    return device


def _check_pin(pin: bool) -> None:
    if pin and not _can_pin():
        raise ValueError("pin=True restores into pinned memory, and there is none here: pinning needs a CUDA "
                         "GPU, or run inside `with pinlab.LaggingStream() as s:` (the emulated one); or pass pin=False")


def _can_pin() -> bool:
    """Can a pinned tensor be made here (a real GPU's allocator, or a LaggingStream's emulation)?"""
    from ..device import has_cuda

    if has_cuda():
        return True
    try:
        torch.empty(0, pin_memory=True)  # 0 bytes: no block is taken
    except RuntimeError:
        return False
    return True


# ---- counting copies -------------------------------------------------------------------------

class _CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in COPY_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def count_copies(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)``; return ``(result, ops)`` where ``ops`` lists the data copies
    it made (aten op names such as ``'_to_copy'``, ``'copy_'``, ``'_pin_memory'``), in order.

    ``t.to("cpu")`` counts as one copy (``_to_copy``), ``t.to("cpu").pin_memory()`` as two,
    ``torch.empty_like(t, device="cpu", pin_memory=True).copy_(t)`` as one (``copy_``).
    """
    callable_arg("fn", fn)
    counter = _CopyCounter()
    with counter:
        out = fn(*args, **kwargs)
    return out, counter.ops


# ---- the reference answer ----------------------------------------------------------------------

def pinned_footprint(sizes) -> int:
    """Bytes PyTorch's caching host allocator page-locks when each of ``sizes`` (bytes) gets its own
    pinned tensor: each request rounded up to a power of two; an empty tensor pins nothing."""
    if isinstance(sizes, (str, bytes, dict)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of byte counts, got {type(sizes).__name__}")
    total = 0
    for i, n in enumerate(sizes):
        n = positive_int(f"sizes[{i}]", n, allow_zero=True)
        total += next_pow2(n) if n else 0
    return total


# ---- GPU harnesses ----------------------------------------------------------------------------

def _wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def d2h_copy_loop_peak(nbytes: int = 256 * MiB, iters: int = 8, trials: int = 3) -> dict:
    """The best pinned D2H rate (GB/s) of a plain loop of back-to-back copies: the reference peak
    a restore into pinned memory is compared with."""
    nbytes = positive_int("nbytes", nbytes)
    iters = positive_int("iters", iters)
    trials = positive_int("trials", trials)
    require_cuda("d2h_copy_loop_peak()")
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def loop():
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)

    stats = cuda_time(loop, repeat=trials)
    del src, dst
    release_cached_host_blocks()
    return {"bytes": nbytes, "iters": iters, "best_GBps": nbytes * iters / (stats.min * 1e-3) / 1e9,
            "median_GBps": nbytes * iters / (stats.median * 1e-3) / 1e9}


def time_restores(restores: dict, *, hidden: int = HIDDEN, inter: int = INTER, blocks: int = BLOCKS,
                  repeat: int = 3, busy_ms: float = BUSY_MS) -> dict:
    """This loop, for every restore method: restore each weight of a model on the GPU to the host
    with ``restores[name](weight)``, ``repeat`` times (the first cold: the pinned allocator's cache
    is emptied before it), then reload the restored weights with ``copy_(..., non_blocking=True)``
    behind a GPU kept busy for ``busy_ms``.

    Per method: host ms of each restore (the restore returns when the data is on the host), the
    copies one restore of one weight makes (:func:`count_copies`), whether the results are pinned,
    the pinned bytes the allocator took (``host_memory_stats``), the host ms the reload blocked,
    and whether the weights came back bitwise identical.
    """
    if not isinstance(restores, dict) or not restores:
        raise TypeError("restores must be a non-empty dict {name: function(weight) -> host tensor}")
    for name, fn in restores.items():
        callable_arg(f"restores[{name!r}]", fn)
    repeat = positive_int("repeat", repeat, maximum=20)
    busy_ms = positive_number("busy_ms", busy_ms)
    require_cuda("time_restores()")
    model = make_model(hidden, inter, blocks, device="cuda")
    weights = [p.data for p in model.parameters()]
    sizes = [w.numel() * w.element_size() for w in weights]
    small = torch.randn(1024, device="cuda").to(weights[0].dtype)
    gpu_busy(1.0)  # calibrates the busy kernel once
    warmup(*(lambda f=f: f(small) for f in restores.values()),
           lambda: small.copy_(small.cpu(), non_blocking=True),
           lambda: small.copy_(small.cpu().pin_memory(), non_blocking=True),
           lambda: torch.equal(small, small))
    out = {"bytes": sum(sizes), "param_bytes": sizes, "busy_ms": busy_ms, "methods": {}}
    for name, fn in progress(restores.items(), desc="restore methods", total=len(restores)):
        release_cached_host_blocks()
        held0 = pinned_bytes_held()
        allocs0 = host_stats().get("num_host_alloc", 0)
        times, held, allocs, host = [], 0, 0, None
        for r in range(repeat):
            host = None  # the previous round's copies are freed first (pinned blocks go back to the cache)
            box = {}
            times.append(_wall_ms(lambda: box.__setitem__("h", [fn(w) for w in weights])))
            host = box.pop("h")
            if r == 0:
                held = pinned_bytes_held() - held0
                allocs = host_stats().get("num_host_alloc", 0) - allocs0
        pinned = [h.is_pinned() for h in host]
        on_host = all(h.device.type == "cpu" for h in host)
        # reload behind a busy GPU: does the host wait?
        torch.cuda.synchronize()
        gpu_busy(busy_ms)
        t0 = time.perf_counter()
        for w, h in zip(weights, host):
            w.copy_(h, non_blocking=True)
        reload_host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        ref = make_model(hidden, inter, blocks, device="cuda")  # the same seed: the same weights
        equal = all(torch.equal(w, p) for w, p in zip(weights, ref.parameters()))
        del ref
        ops = count_copies(fn, weights[0])[1]  # the copy it returns is freed at once
        torch.cuda.synchronize()
        out["methods"][name] = {
            "restore_ms": times, "cold_ms": times[0], "warm_ms": min(times[1:]) if repeat > 1 else times[0],
            "copies_per_weight": len(ops), "copy_ops": ops, "pinned": all(pinned), "on_host": on_host,
            "pinned_bytes_delta": held, "host_allocs": allocs,
            "reload_host_ms": reload_host_ms, "bitwise_equal": equal,
        }
        del host
        release_cached_host_blocks()
    del model, weights, small
    torch.cuda.empty_cache()
    return out


def sleep_wake_sweep(sleep, wake, *, sizes=SLEEP_SIZES, blocks: int = BLOCKS) -> list[dict]:
    """This cycle, for every model size: ``sleep(model, pin)`` offloads every weight to the host and
    frees its GPU memory, ``wake(model, device)`` brings them back.

    Per size, pinned (cold: the allocator's cache emptied first; then warm: a second cycle) and
    pageable: host ms of each sleep and wake (until the data is there), the pinned bytes held
    while asleep, whether ``torch.cuda.memory_allocated()`` went back to the baseline (the
    model's bytes all freed) and whether every weight came back bitwise identical.
    """
    callable_arg("sleep", sleep)
    callable_arg("wake", wake)
    sizes = size_list("sizes", sizes)
    blocks = positive_int("blocks", blocks)
    require_cuda("sleep_wake_sweep()")
    tiny = make_model(256, 688, 1, device="cuda")  # warm every kernel of the cycle
    for pin in (True, False):
        sleep(tiny, pin)
        wake(tiny, "cuda")
    torch.cuda.synchronize()
    del tiny
    rows = []
    for target in progress(sizes, desc="sleep/wake sizes"):
        hidden, inter = mlp_shape_for(target, blocks)
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()
        model = make_model(hidden, inter, blocks, device="cuda")
        sizes_b = [p.numel() * p.element_size() for p in model.parameters()]
        # host-side checksums (Python ints): nothing extra stays in GPU memory
        checksum = [int(p.detach().view(torch.int16).sum(dtype=torch.int64)) for p in model.parameters()]
        reserved_awake = torch.cuda.memory_reserved()
        row = {"target_bytes": target, "bytes": sum(sizes_b), "hidden": hidden, "inter": inter,
               "param_bytes": sizes_b}
        freed, equal = [], []
        for label, pin in (("pinned_cold", True), ("pinned_warm", True), ("pageable", False)):
            if label != "pinned_warm":
                release_cached_host_blocks()  # cold: the pinned allocator starts empty
            held0 = pinned_bytes_held()
            row[f"{label}_sleep_ms"] = _wall_ms(lambda: sleep(model, pin))
            freed.append(torch.cuda.memory_allocated() == baseline)
            row[f"{label}_reserved_freed_bytes"] = reserved_awake - torch.cuda.memory_reserved()
            row[f"{label}_new_pinned_bytes"] = pinned_bytes_held() - held0
            row[f"{label}_pinned_held_bytes"] = pinned_bytes_held()
            row[f"{label}_host_pinned"] = all(p.is_pinned() for p in model.parameters())
            row[f"{label}_wake_ms"] = _wall_ms(lambda: wake(model, "cuda"))
            equal.append(all(p.device.type == "cuda" and int(p.detach().view(torch.int16).sum(dtype=torch.int64)) == c
                             for p, c in zip(model.parameters(), checksum)))
        row["gpu_freed_every_sleep"] = all(freed)
        row["checksums_equal_every_wake"] = all(equal)
        # a bitwise check of the last wake against freshly drawn weights (the same seed)
        ref = make_model(hidden, inter, blocks, device="cuda")
        row["bitwise_equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
        rows.append(row)
        del model, ref
        torch.cuda.synchronize()
        release_cached_host_blocks()
        torch.cuda.empty_cache()
    return rows


def zero_copy_matmul(view_fn, *, hidden: int = HIDDEN, inter: int = INTER, tokens: int = 16,
                     repeat: int = 10) -> dict:
    """One weight (``inter x hidden`` bf16) used by a matmul with ``tokens`` rows, three ways:
    resident in GPU memory; pinned on the host and copied to the GPU for every use; and read by
    the GPU straight from pinned host memory through ``view_fn(pinned)`` (a zero-copy CUDA view),
    if ``view_fn`` can make one here (otherwise its error is recorded). GPU ms per use (CUDA
    events, median of ``repeat``) and whether each way computed the same output.
    """
    callable_arg("view_fn", view_fn)
    require_cuda("zero_copy_matmul()")
    hidden = positive_int("hidden", hidden)
    inter = positive_int("inter", inter)
    tokens = positive_int("tokens", tokens)
    repeat = positive_int("repeat", repeat, maximum=100)
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(inter, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    pinned = torch.empty_like(w, device="cpu", pin_memory=True).copy_(w)
    staging = torch.empty_like(w)
    nbytes = w.numel() * w.element_size()
    linear = torch.nn.functional.linear
    y_ref = linear(x, w)

    def copied():
        staging.copy_(pinned, non_blocking=True)
        return linear(x, staging)

    out = {"bytes": nbytes, "tokens": tokens, "ways": {}}
    resident = cuda_time(lambda: linear(x, w), repeat=repeat, warmup=2)
    out["ways"]["resident"] = {"ms": resident.median, "same_output": True}
    per_use = cuda_time(copied, repeat=repeat, warmup=2)
    out["ways"]["copied_per_use"] = {"ms": per_use.median, "same_output": bool(torch.equal(copied(), y_ref))}
    try:
        view = view_fn(pinned)
        ok = view.device.type == "cuda" and view.shape == w.shape and view.dtype == w.dtype
        if not ok:
            raise RuntimeError(f"view_fn returned {view.device} {tuple(view.shape)} {view.dtype}")
        info = {"available": True, "error": None,
                "same_pointer_as_host": view.data_ptr() == pinned.data_ptr(),
                "view_equals_weight": bool(torch.equal(view, w))}
        zc = cuda_time(lambda: linear(x, view), repeat=repeat, warmup=2)
        info.update(ms=zc.median, same_output=bool(torch.equal(linear(x, view), y_ref)))
        # the view reads host memory: a write on the host is seen by the next kernel, no copy
        pinned[0, 0] = pinned[0, 0] + 1
        info["host_write_seen_by_gpu"] = bool(view[0, 0].item() == pinned[0, 0].item())
        del view
    except Exception as exc:  # no zero-copy view on this torch/GPU: recorded, and said so
        info = {"available": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["ways"]["zero_copy"] = info
    torch.cuda.synchronize()
    del w, x, pinned, staging
    release_cached_host_blocks()
    return out


# ---- plots --------------------------------------------------------------------------------------------------

#: the sweep's rows that the sleep/wake figure draws (``sleep_wake_sweep``'s keys), with their legend labels
SLEEP_WAKE_SERIES = (("pinned_cold_sleep_ms", "sleep, pinned cold"), ("pinned_warm_sleep_ms", "sleep, pinned warm"),
                     ("pageable_sleep_ms", "sleep, pageable"), ("pinned_warm_wake_ms", "wake, pinned"),
                     ("pageable_wake_ms", "wake, pageable"))


def plot_sleep_wake(rows, *, tag: str):
    """Two stacked panels from :func:`sleep_wake_sweep`'s rows: the host's sleep and wake times per model size,
    and the pinned host memory held while asleep against the weights' bytes. ``tag`` names the run (a
    measurement's ``.tag``). Returns the figure."""
    from ..plots import size_sweep, stacked

    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise TypeError("rows must be sleep_wake_sweep's non-empty list of dicts (pinlab.measure(...).result)")
    missing = sorted(({k for k, _ in SLEEP_WAKE_SERIES} | {"bytes", "pinned_cold_new_pinned_bytes"}) - set(rows[0]))
    if missing:
        raise ValueError(f"rows lack {missing}: pass sleep_wake_sweep's rows")
    sizes = [r["bytes"] for r in rows]
    fig, (ax1, ax2) = stacked(2, height=3.6)
    size_sweep(sizes, {label: [r[key] for r in rows] for key, label in SLEEP_WAKE_SERIES},
               ylabel="host ms", title=f"Sleep / wake time ({tag})", ax=ax1)
    ax1.set_xlabel("model size")
    size_sweep(sizes, {"weights": sizes, "pinned held while asleep": [r["pinned_cold_new_pinned_bytes"] for r in rows]},
               ylabel="bytes", title="The price: pinned host memory", ax=ax2)
    ax2.set_xlabel("model size")
    return fig


# ---- issue 31: the notebook's reasons (why a fact may not hold on some machine) and table columns ----------

#: why a claim or an observation of the notebook may not hold on some machine: ``why=wr.WHY.rounding``
WHY = Reasons(
    copy_ops="count_copies counts the aten ops that copy data; another torch version may route .to('cpu') or "
             "pin_memory() through other ops",
    emulated="the emulated stream is exact about where each weight lives and what it holds: only a changed "
             "device_loading_context, sleep() or wake() makes this fail",
    emulated_staging="the emulated stream waits at a pageable copy as the course's model of the driver does (a copy "
                     "this large waits), and queues a pinned one: only a changed emulation makes this fail",
    emulated_bytes="the emulation counts the bytes of live pinned tensors, without the allocator's rounding",
    blocking_d2h="a blocking D2H copy returns with its data on the host, on any GPU: only a restore that copied with "
                 "non_blocking=True and was read before it ran fails",
    per_weight="its four blocking copies each pay a launch and a host synchronization the copy loop does not; a "
               "slower host, or a GPU shared with others, loses more of the peak to them",
    pageable_gap="the gap is the link's pinned rate against the host's pageable path (the driver's staging): a slow "
                 "link (PCIe Gen3), a slow host, or a GPU that reads pageable memory through the host's page tables "
                 "(GH200, not measured here) narrows it",
    rounding="PyTorch's caching host allocator rounds every pinned request up to a power of two; another torch "
             "version, or pinned-memory options in PYTORCH_CUDA_ALLOC_CONF, may round differently",
    pinned_queued="a non_blocking copy from pinned memory is queued on any CUDA GPU; only a host stalled for "
                  "milliseconds by something else (the OS, too few CPU cores) shows more",
    pageable_waits="when a pageable copy waits is the driver's choice (undocumented); a GPU that reads pageable "
                   "memory through the host's page tables (GH200, not measured here) may not stage it at all",
    empty_cache="a sleep also drops the GPU copies and runs torch.cuda.empty_cache(), which count against it, the "
                "more the smaller the model",
    gpu_freed="memory_allocated() counts this process's tensors only (other processes on the GPU do not change it): "
              "only a GPU weight still referenced after sleep() keeps it up",
    exact_copies="copies are exact on any GPU: only a weight read before its copy ran differs",
    pin_switch="sleep(model, pin) allocates pinned memory exactly when pin=True",
    same_bytes="the same kernels read the same bytes, resident, copied or in place: only a view of other memory "
               "than the pinned buffer (a platform without unified virtual addressing) differs",
    pinned_back="a pinned tensor of this notebook is still referenced (a restored weight kept alive), or another "
                "library in this process took pinned memory",
)


def _size(n) -> str:
    from ..plots import fmt_bytes

    return fmt_bytes(n)


#: the columns of the notebook's tables: the restores (one row per method), the sleep/wake sweep (one per size)
RESTORE_COLUMNS = [("method", "restore"), ("cold_ms", "cold", fmt_ms), ("warm_ms", "warm", fmt_ms),
                   ("copies_per_weight", "copies/weight"), ("pinned", "pinned"),
                   ("pinned_bytes_delta", "pinned bytes", _size), ("reload_host_ms", "reload: host held", fmt_ms)]
SLEEP_WAKE_COLUMNS = [("bytes", "model", _size), ("pinned_cold_sleep_ms", "sleep pinned cold", fmt_ms),
                      ("pinned_warm_sleep_ms", "sleep pinned warm", fmt_ms),
                      ("pageable_sleep_ms", "sleep pageable", fmt_ms),
                      ("pinned_warm_wake_ms", "wake pinned", fmt_ms), ("pageable_wake_ms", "wake pageable", fmt_ms),
                      ("pinned_cold_new_pinned_bytes", "pinned held", _size)]
