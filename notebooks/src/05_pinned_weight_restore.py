# %% [markdown]
# # 05 · Restoring offloaded weights straight into pinned memory
#
# **What you will learn**
# - three ways to put an offloaded weight back on the host (vLLM's `device_loading_context`):
#   `.to("cpu")` (pageable), `.to("cpu").pin_memory()` (two copies),
#   `torch.empty_like(w, device="cpu", pin_memory=True).copy_(w)` (one copy, pinned);
# - how to count a line's copies, and prove a round trip bitwise exact;
# - on a model-sized module: restore bandwidth against the link's peak, the pinned bytes taken,
#   and what the next reload costs the host;
# - a sleep/wake cycle (vLLM's sleep mode) from 64 MiB to a few GiB; when *not* to pin;
# - zero-copy: the GPU reading pinned host memory directly (vLLM's UVA offloader).
#
# Part 1 runs everywhere, on the emulated lagging stream (`pinlab.LaggingStream`, lesson 02). Part
# 2 measures on a GPU, or replays the recorded run.

# %%
# Install cell: on Colab, or in any Python without the course, run this first.
# Where `import pinlab` works (a clone set up with `make lab`), it does nothing.
import importlib.util

if importlib.util.find_spec("pinlab") is None:
    raise ModuleNotFoundError(
        "pinlab is not installed here, and this copy of the course names no address "
        "to install it from: clone the course and run `make lab` in it (whoever "
        "publishes the course runs `make publish URL=<its address>`)."
    )

# %% tags=["nbval-ignore-output"]
import contextlib
import os

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l05_pinned_weight_restore as wr
from pinlab.plots import bars, fmt_bytes

MiB, GiB = wr.MiB, wr.GiB
pinlab.header("05 pinned weight restore")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Where weights go back to the host
#
# vLLM can keep part of a model in host memory (`--cpu-offload-gb`). Some quantization methods
# post-process every weight after loading (`process_weights_after_loading`) on the GPU, inside
# `device_loading_context(module, target_device)`: on entry it moves each CPU parameter to the
# GPU, on exit **back to the host**. Sleep mode (for RL, or several models on one GPU) does the
# same for the whole model. How a weight goes back decides its *next* trip: only pinned memory is
# copied asynchronously (lessons 01 and 02).
#
# **UVA** (unified virtual addressing): the GPU can address pinned host memory directly, so a
# kernel reads a weight that stays on the host, over the link, with no copy. vLLM's UVA offloader
# keeps offloaded weights that way, so they must be *pinned* ("Zero-copy" below). The lines that
# matter, before and after the vLLM change (vLLM 0.28 → 0.29):

# %%
# vLLM's switch: VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1
# turns pinning off (see "When not to pin")
DISABLE_PIN = os.environ.get("VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY", "0") not in (
    "",
    "0",
)


def restore_before(w):
    """vLLM 0.28, device_loading_context: the weight comes back in pageable memory."""
    return w.to("cpu")


def restore_before_uva(w):
    """vLLM 0.28, re-offloading a UVA weight: a pageable
    copy, then a second copy into pinned memory."""
    return w.to("cpu").pin_memory()


def restore_after(w, pin=not DISABLE_PIN):
    """vLLM 0.29: allocate the pinned destination
    first, then copy once, straight into it."""
    return torch.empty_like(w, device="cpu", pin_memory=pin).copy_(w)


RESTORES = {
    "to_cpu": restore_before,
    "to_cpu_pin_memory": restore_before_uva,
    "empty_pinned_copy": restore_after,
}

# %% [markdown]
# The context manager, as in vLLM 0.29 (shortened; `wr.check_restore_args` only checks arguments):


# %%
@contextlib.contextmanager
def device_loading_context(module, target_device, pin=not DISABLE_PIN):
    """Move the module's host parameters to target_device
    for the block; restore them, pinned, after."""
    target = wr.check_restore_args(module, target_device, pin=pin)
    host_params = {
        name for name, p in module.named_parameters() if p.device.type == "cpu"
    }
    for name, p in module.named_parameters():
        if name in host_params:
            p.data = p.data.to(target)
    try:
        yield module
    finally:
        for name, p in module.named_parameters():
            if name in host_params:
                p.data = torch.empty_like(p.data, device="cpu", pin_memory=pin).copy_(
                    p.data
                )


def offload(module, restore=restore_after):
    """Restore every parameter of module to the host with restore(weight)."""
    wr.check_restore_args(module)
    for p in module.parameters():
        p.data = restore(p.data)
    return module


# %% [markdown]
# # Part 1 · The code, run here (emulated)
#
# Inside `with pinlab.LaggingStream() as s:` torch runs as if a far-behind GPU were attached:
# `pin_memory=True` and `is_pinned()` work on a CPU, a tensor on `s.device` is "GPU memory", and
# device work runs only when the host waits for it. It is exact about *what* is copied, pinned,
# queued or waited for, silent about time, and the same on every machine.
#
# 🔮 **Predict.** How many copies of a weight does each restore make, and which results are pinned?
#
# <details><summary>Answer</summary>
#
# `.to("cpu")`: one copy, pageable. `.to("cpu").pin_memory()`: two copies (to pageable memory, then
# into a fresh pinned buffer), pinned. `empty_like(..., pin_memory=True).copy_()`: one copy, pinned.
# </details>

# %%
EMU = dict(hidden=1024, inter=2752, blocks=2)  # 4 bf16 matrices of 5.4 MiB: 21.5 MiB
host_model = wr.make_model(**EMU)
reference = [p.detach().clone() for p in host_model.parameters()]

with pinlab.LaggingStream() as s:
    gpu_model = wr.make_model(**EMU)
    for p in gpu_model.parameters():
        p.data = p.data.to(s.device)  # "on the GPU"
    found = {}
    for name, restore in RESTORES.items():
        w = next(gpu_model.parameters()).data
        host, ops = wr.count_copies(restore, w)
        found[name] = (len(ops), host.is_pinned(), torch.equal(host, reference[0]))
        print(
            f"{name:18s} copies: {len(ops)}, pinned: "
            f"{host.is_pinned()}, bitwise equal: {found[name][2]}"
        )
pinlab.claim(
    "copies 1, 2 and 1; pinned: no, yes, yes; every result bitwise equal",
    list(found.values()) == [(1, False, True), (2, True, True), (1, True, True)],
    value=found,
    why=wr.WHY.copy_ops,
)

# %% [markdown]
# `count_copies` counts the aten ops that copy data (`_to_copy`, `copy_`, `_pin_memory`, ...)
# while the function runs (a `TorchDispatchMode`), on a GPU too.
#
# ### A round trip through `device_loading_context`, and the switch
#
# Offloaded weights go to the "GPU" and come back: bitwise identical, pinned, or pageable when the
# switch is off.

# %%
with pinlab.LaggingStream() as s:
    offloaded = wr.make_model(**EMU)
    for pin in (True, False):
        with device_loading_context(offloaded, s.device, pin=pin) as m:
            on_gpu = all(s.is_device(p) for p in m.parameters())
        back = [p.data for p in offloaded.parameters()]
        exact = all(torch.equal(b, r) for b, r in zip(back, reference))
        print(
            f"pin={pin}: on the GPU inside: {on_gpu}; back on the host pinned: "
            f"{all(b.is_pinned() for b in back)}; bitwise equal: {exact}"
        )
        pinlab.claim(
            f"pin={pin}: on the GPU inside, back "
            "bitwise equal, pinned exactly when pin=True",
            on_gpu and exact and all(b.is_pinned() == pin for b in back),
            shown=False,
            why=wr.WHY.emulated,
        )

# %% [markdown]
# ### Why pinned matters for the *next* trip: reloading behind a busy GPU
#
# Restored weights return to the GPU (the next `device_loading_context`, wake-up or prefetch),
# ideally with `copy_(..., non_blocking=True)` while the GPU works on something else. From pinned
# memory the copy is only *queued*; from pageable memory a copy this large usually waits for the
# GPU (lesson 02's fake `non_blocking`: undocumented driver behaviour). The emulated stream takes
# the waiting case.
#
# 🔮 **Predict.** After issuing the four reload copies, how many are still queued behind the
# (emulated) busy GPU, from pinned and from pageable host weights?
#
# <details><summary>Answer</summary>
#
# Pinned: the busy work and all four copies, five items. Pageable: none: the first copy, too large
# to stage behind the queue, waits until the GPU has run everything before it, and so does every
# later one.
# </details>

# %%
queued, reloaded = {}, {}
with pinlab.LaggingStream() as s:
    for name in ("to_cpu", "empty_pinned_copy"):
        model = wr.make_model(**EMU)
        gpu = [p.data.to(s.device) for p in model.parameters()]
        host = [RESTORES[name](g) for g in gpu]
        s.launch(lambda: None)  # the GPU is busy with other work
        for g, h in zip(gpu, host):
            g.copy_(h, non_blocking=True)  # reload
        queued[name] = s.pending()
        s.synchronize()
        reloaded[name] = all(torch.equal(g.cpu(), r) for g, r in zip(gpu, reference))
        print(
            f"from {name:18s}: {queued[name]} queued items after the reload "
            f"""({
                "the host did not wait"
                if queued[name] > len(gpu)
                else "the host waited for the GPU"
            })"""
        )
pinlab.claim(
    "from pinned memory the busy work and all four copies are still queued",
    queued["empty_pinned_copy"] == 5,
    value=queued["empty_pinned_copy"],
    why=wr.WHY.emulated_staging,
)
pinlab.claim(
    "from pageable memory nothing is left queued",
    queued["to_cpu"] == 0,
    value=queued["to_cpu"],
    why=wr.WHY.emulated_staging,
)
pinlab.claim(
    "every reloaded weight is bitwise equal",
    all(reloaded.values()),
    why=wr.WHY.emulated_staging,
)

# %% [markdown]
# ### Bad input gets a clear error
#
# A restore given a non-module, `meta` parameters (a shape without data) or a missing device
# should say so, not fail deep inside torch.

# %% tags=["nbval-ignore-output"]
meta_model = torch.nn.Linear(4, 4, device="meta")
cases = {
    "not a module": ("weights.pt", None),
    "meta parameters": (meta_model, None),
    "no such device": (host_model, "cuda:99"),
    "misspelt device": (host_model, "gpu"),
}
if not pinlab.has_cuda():
    cases["no CUDA here"] = (host_model, "cuda")
for label, (module, target) in cases.items():
    try:
        with device_loading_context(module, target or "cpu"):
            pass
        raise AssertionError(f"{label}: accepted")
    except (TypeError, ValueError, pinlab.CudaUnavailableError) as exc:
        print(
            pinlab.timing.wrapped(
                f"{label:16s} -> {type(exc).__name__}: {exc}", indent=20
            )
        )

# %% [markdown]
# ### A sleep/wake cycle
#
# vLLM's sleep mode frees the GPU for something else (a trainer in RL, another model) and brings
# the weights back later:


# %%
def sleep(model, pin=not DISABLE_PIN):
    """Offload every weight to host memory (pinned
    unless pin=False) and free its GPU memory."""
    for p in model.parameters():
        p.data = torch.empty_like(p.data, device="cpu", pin_memory=pin).copy_(p.data)
    # give the freed blocks back to the driver (a no-op without CUDA)
    torch.cuda.empty_cache()


def wake(model, device):
    """Bring every weight back; from pinned memory
    the copies are queued, not waited for."""
    for p in model.parameters():
        p.data = p.data.to(device, non_blocking=True)
    # synchronize (or order the next kernels on this
    # stream) before the host reads the weights


with pinlab.LaggingStream() as s:
    model = wr.make_model(**EMU)
    wake(model, s.device)
    for cycle in range(3):
        sleep(model)
        asleep_pinned = all(p.is_pinned() for p in model.parameters())
        pinned_held = s.pinned_bytes()
        wake(model, s.device)
        s.synchronize()
        exact = all(
            torch.equal(p.cpu(), r) for p, r in zip(model.parameters(), reference)
        )
        print(
            f"cycle {cycle}: asleep in pinned memory: {asleep_pinned}, pinned "
            f"bytes held: {fmt_bytes(pinned_held)}, awake and bitwise equal: {exact}"
        )
        pinlab.claim(
            f"cycle {cycle}: asleep in pinned memory, awake bitwise equal",
            asleep_pinned and exact,
            shown=False,
            why=wr.WHY.emulated,
        )
    pinlab.claim(
        "emulated pinned bytes equal the weights' bytes (no rounding in the emulation)",
        pinned_held == sum(wr.param_bytes(model)),
        value=pinned_held,
        why=wr.WHY.emulated_bytes,
    )

# %% [markdown]
# On a GPU, `torch.cuda.memory_allocated()` must drop to its level before the model while it
# sleeps, and the pinned allocator rounds each block up to a power of two: Part 2 measures both.
#
# # Part 2 · Measured on a GPU
#
# Or replayed from the recorded GPU run (the `[measured] source:` line says which).
#
# ## The reference: a plain pinned D2H copy loop
#
# A restore into pinned memory is a D2H copy. The link's D2H peak is what a loop of back-to-back
# 256 MiB copies into pinned memory reaches (best of 3).

# %%
peak = pinlab.measure(
    "05_d2h_copy_loop_peak", wr.d2h_copy_loop_peak, nbytes=256 * MiB, iters=8, trials=3
)
pinlab.show("pinned D2H copy-loop peak", f"{peak['best_GBps']:.1f} GB/s")

# %% [markdown]
# ## Restoring a model-sized module, three ways
#
# The model: two Llama-2-7B-shaped MLP blocks (hidden 4096, intermediate 11008), four bf16 weights
# of 86 MiB each, 344 MiB in all, on the GPU. For each restore, `wr.time_restores` restores every
# weight (3 rounds; the pinned cache is emptied first, so round 1 is *cold*, later rounds reuse
# cached blocks, *warm*), counts the copies, then reloads the weights with
# `copy_(..., non_blocking=True)` behind 20 ms of GPU work and times how long the host was held.
#
# 🔮 **Predict.** Which restore is fastest, and by how much? Is `.to("cpu").pin_memory()` faster or
# slower than plain `.to("cpu")`?
#
# <details><summary>Answer</summary>
#
# The pinned copy, by far, **once its blocks are cached** (warm): it moves the bytes at the link's
# rate, while `.to("cpu")` copies into fresh pageable memory (page faults on every new page, a
# staged copy); how far depends on link and host. The *first* (cold) pinned restore also
# page-locks fresh memory, which costs far more than the copy: the same order of time as
# `.to("cpu")`. `.to("cpu").pin_memory()` makes that copy, then a second into pinned memory
# (page-locking it too when cold): at least as slow as `.to("cpu")`, much slower cold.
# </details>

# %%
res = pinlab.measure(
    "05_restore",
    lambda **kw: wr.time_restores(RESTORES, **kw),
    hidden=wr.HIDDEN,
    inter=wr.INTER,
    blocks=wr.BLOCKS,
    repeat=3,
    busy_ms=20.0,
)
methods = res["methods"]
print("model:", len(res["param_bytes"]), "weights,", fmt_bytes(res["bytes"]))

# %% tags=["nbval-ignore-output"]
pinlab.table([{"method": k, **v} for k, v in methods.items()], wr.RESTORE_COLUMNS)

# %%
bars(
    list(methods),
    [v["warm_ms"] for v in methods.values()],
    ylabel="host ms per restore (warm)",
    logy=True,
    title=f"Restoring {fmt_bytes(res['bytes'])} of bf16 weights ({res.tag})",
    annotate="{:.1f}",
)
plt.show()

# %% [markdown]
# The exact facts, on every run:

# %%
for name, v in methods.items():
    print(
        pinlab.timing.wrapped(
            f"{name:18s} copies per weight: {v['copies_per_weight']}, "
            f"pinned: {v['pinned']}, on the host: {v['on_host']}, "
            f"reloaded bitwise equal: {v['bitwise_equal']}",
            indent=19,
        )
    )
copies = [v["copies_per_weight"] for v in methods.values()]
pinlab.claim(
    "copies per weight 1, 2 and 1",
    copies == [1, 2, 1],
    value=copies,
    why=wr.WHY.copy_ops,
)
pinlab.claim(
    "every restore on the host, every reload bitwise equal",
    all(v["bitwise_equal"] and v["on_host"] for v in methods.values()),
    why=wr.WHY.blocking_d2h,
)

# %% [markdown]
# ### Restore bandwidth against the link's peak, and the speed-up
#
# The pinned restore is one blocking D2H copy per weight; warm, it should reach 90% of the
# copy-loop peak at this size. It loses per-weight overhead the loop does not pay: a block from
# the pinned cache, a launch and a host synchronization per weight (four here). Observed, not
# asserted: a ratio near 1 moves with the run, the host and a shared GPU. The speed-ups compare
# medians of three rounds; their size depends on the link and on how the host handles pageable
# memory (on a GH200 the GPU reads pageable memory through the host's page tables, and the gap
# narrows: not measured here, `docs/facts.md` F15).

# %%
after, before, uva = (
    methods["empty_pinned_copy"],
    methods["to_cpu"],
    methods["to_cpu_pin_memory"],
)
median = lambda v: sorted(v["restore_ms"])[len(v["restore_ms"]) // 2]  # noqa: E731
restore_gbps = res["bytes"] / (after["warm_ms"] * 1e-3) / 1e9
pinlab.show("pinned restore (warm)", f"{restore_gbps:.1f} GB/s")
pinlab.observe(
    "the warm pinned restore reaches 90% of the D2H copy-loop peak",
    restore_gbps >= 0.9 * peak["best_GBps"],
    value=f"{restore_gbps / peak['best_GBps']:.3f} of it",
    why=wr.WHY.per_weight,
)
cold_gbps = res["bytes"] / (after["cold_ms"] * 1e-3) / 1e9
pinlab.show(
    "pinned restore, cold / D2H copy-loop peak", f"{cold_gbps / peak['best_GBps']:.3f}"
)
pinlab.show(
    "speed-up of the pinned restore over .to('cpu'), median of rounds",
    f"{median(before) / median(after):.1f}x",
)
pinlab.show(
    "speed-up over .to('cpu').pin_memory(), median of rounds",
    f"{median(uva) / median(after):.1f}x",
)
pinlab.report(
    "pinned restore, cold (the allocator page-locks new blocks)", after["cold_ms"]
)
pinlab.report("pinned restore, warm (cached pinned blocks)", after["warm_ms"])
pinlab.observe(
    "the warm pinned restore is at least 2x faster than .to('cpu')",
    2 * after["warm_ms"] < before["warm_ms"],
    value=f"{before['warm_ms'] / after['warm_ms']:.1f}x",
    why=wr.WHY.pageable_gap,
)
pinlab.show(
    "what this run shows",
    f"page-locking fresh memory took {after['cold_ms'] - after['warm_ms']:.0f} "
    f"ms of the cold restore's {after['cold_ms']:.0f} ms; "
    "the warm restore is the copies plus their per-weight overhead",
)

# %% [markdown]
# The 90% goal is about the warm path: no page-locking. The cold round also page-locks new memory
# (`cudaHostAlloc`, lesson 01): compare the cold and warm lines. Repeated restores (sleep/wake
# below) pay it once per block, then reuse cached blocks.
#
# ### The pinned bytes it takes: rounded up to powers of two
#
# 🔮 **Predict.** Each weight is 86 MiB. How many bytes does the caching host allocator page-lock
# for the four?
#
# <details><summary>Answer</summary>
#
# 512 MiB: it rounds every request up to a power of two (lesson 01), so each 86 MiB weight takes a
# 128 MiB block, about 1.5 times what was asked. `.to("cpu")` takes none: its result is pageable.
# </details>

# %%
requested = res["bytes"]
expected = wr.pinned_footprint(res["param_bytes"])
for name, v in methods.items():
    pinlab.show(f"{name}: pinned bytes taken", fmt_bytes(v["pinned_bytes_delta"]))
print(
    "requested:",
    fmt_bytes(requested),
    "-> rounded up per weight:",
    fmt_bytes(expected),
    f"({expected / requested:.2f}x)",
)
taken = [v["pinned_bytes_delta"] for v in methods.values()]
pinlab.claim(
    "both pinned restores took exactly the rounded bytes, .to('cpu') none",
    taken == [0, expected, expected],
    value=taken,
    why=wr.WHY.rounding,
)

# %% [markdown]
# Every 86 MiB weight occupies a 128 MiB pinned block: 1.49× the memory asked for, locked in RAM
# as long as the weights live there: the *price* of the fast path.
#
# ### Reloading behind a busy GPU
#
# Part 1's reload, on the GPU: 20 ms of GPU work, then the four weights copied back with
# `non_blocking=True`. A host that waits is held at least the rest of the busy time; one that
# only queues is not: half the busy time separates them, unless staging itself takes that long (a
# pageable copy of a few hundred MiB can: lesson 01's pageable rates), so a pageable host held
# past the line waited *or* staged. From pinned memory the copies are only queued, on any CUDA
# GPU. Whether a pageable copy waits is the driver's undocumented choice: the CUDA Runtime API's
# "API synchronization behavior" page
# (https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html) says only that an
# asynchronous copy from pageable memory may be synchronous.

# %%
for name, v in methods.items():
    pinlab.report(f"reload from {name}: host held", v["reload_host_ms"])
pinlab.observe(
    "from pageable memory (.to('cpu')) the host was held over half the busy time "
    "(it waited for the busy GPU, or staging the copies took that long by itself)",
    before["reload_host_ms"] > res["busy_ms"] / 2,
    value=pinlab.fmt_ms(before["reload_host_ms"]),
    why=wr.WHY.pageable_waits,
)
pinlab.claim(
    "from pinned memory (empty_like + copy_) the host did not "
    "wait for the busy GPU (held less than half the busy time)",
    after["reload_host_ms"] < res["busy_ms"] / 2,
    value=pinlab.fmt_ms(after["reload_host_ms"]),
    why=wr.WHY.pinned_queued,
)

# %% [markdown]
# ## Sleep and wake, from 64 MiB to a few GiB
#
# `wr.sleep_wake_sweep` runs the cycle on models of about 64 MiB, 256 MiB, 1 GiB and 3 GiB: pinned
# cold (fresh page-locked blocks), pinned warm (a second cycle, cached blocks), and pageable
# (`pin=False`). The largest locks a few GiB of host RAM (the table's last column): run it where
# that much is free.

# %%
sweep = pinlab.measure(
    "05_sleep_wake",
    lambda **kw: wr.sleep_wake_sweep(sleep, wake, **kw),
    sizes=wr.SLEEP_SIZES,
    blocks=wr.BLOCKS,
)
rows = sweep.result

# %% tags=["nbval-ignore-output"]
pinlab.table(rows, wr.SLEEP_WAKE_COLUMNS)

# %%
# sleep and wake times per size; the pinned memory held while asleep
wr.plot_sleep_wake(rows, tag=sweep.tag)
plt.show()

# %%
for r in rows:
    pinlab.show(
        f"{fmt_bytes(r['bytes'])}: wake pinned / pageable",
        f"{r['pinned_warm_wake_ms']:.1f} / {r['pageable_wake_ms']:.1f} "
        f"ms; pinned held {fmt_bytes(r['pinned_cold_new_pinned_bytes'])}",
    )
for r in rows:
    if r["bytes"] >= 256 * MiB:
        sleep_gbps = r["bytes"] / (r["pinned_warm_sleep_ms"] * 1e-3) / 1e9
        pinlab.observe(
            f"{fmt_bytes(r['bytes'])}: the warm pinned "
            "sleep reaches 90% of the D2H copy-loop peak",
            sleep_gbps >= 0.9 * peak["best_GBps"],
            value=f"{sleep_gbps / peak['best_GBps']:.3f} of it",
            why=wr.WHY.empty_cache,
        )
rounded = all(
    r["pinned_cold_new_pinned_bytes"] == wr.pinned_footprint(r["param_bytes"])
    for r in rows
)
as_switched = all(
    r["pinned_cold_host_pinned"]
    and r["pinned_warm_host_pinned"]
    and not r["pageable_host_pinned"]
    for r in rows
)
big = rows[-1]
pinlab.observe(
    "at the largest size, a pinned wake is at least 2x faster than a pageable one",
    2 * big["pinned_warm_wake_ms"] < big["pageable_wake_ms"],
    value=f"{big['pageable_wake_ms'] / big['pinned_warm_wake_ms']:.1f}x",
    why=wr.WHY.pageable_gap,
)
pinlab.claim(
    "every sleep freed the model's GPU memory (memory_allocated back to the baseline)",
    all(r["gpu_freed_every_sleep"] for r in rows),
    why=wr.WHY.gpu_freed,
)
pinlab.claim(
    "every wake brought every weight back bitwise identical",
    all(r["checksums_equal_every_wake"] and r["bitwise_equal"] for r in rows),
    why=wr.WHY.exact_copies,
)
pinlab.claim(
    "pinned bytes held while asleep = the weights "
    "rounded up to powers of two, at every size",
    rounded,
    why=wr.WHY.rounding,
)
pinlab.claim(
    "asleep in pinned memory with pin=True, pageable with pin=False",
    as_switched,
    why=wr.WHY.pin_switch,
)

# %% [markdown]
# Left plot: a warm pinned sleep and every pinned wake grow roughly with the model's size (bytes
# over a rate not far below the link's); the *cold* pinned sleep pays for page-locking, which can
# cost more than a pageable sleep (see the table). So pin when the cycle **repeats** (RL steps,
# switching models): later cycles are warm. Right plot, the price: up to 2× the model's bytes
# locked in host RAM (each block rounded up to a power of two), which the OS can neither swap nor
# give to anyone else.
#
# The warm sleep is the pinned restore again, so the same 90% goal applies at more sizes (the
# lines above say where this run reached it), though its time also includes dropping the GPU
# copies and `torch.cuda.empty_cache()` (freed GPU memory back to the driver): part of a sleep's
# cost, counted against its ratio, the more the smaller the model.
#
# ## When *not* to pin
# - **Host RAM is short.** A 70B model in bf16 is 140 GB; pinned and rounded up, it can lock far
#   more. Pinned memory cannot be swapped: pin too much and other processes (or this one) are
#   killed.
# - **A one-off restore.** A cold pinned restore pays for page-locking fresh memory: it can take
#   as long as the pageable copy it replaces, and then keeps that memory locked.
# - **The footprint does not fit.** Rounding can double an offloaded model's pinned bytes: that is
#   why `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY` came first (pinned blocks rounded up to powers
#   of two ran a GB300 host out of memory). `pin=False` above is its switch.
# - **Grace Hopper / Grace Blackwell** (GH200, GB200, GB300; not measured here: `docs/facts.md`
#   F14, F15). The CPU's LPDDR5X and the GPU's HBM are separate memories, but coherent over
#   NVLink-C2C: the GPU reads pageable host memory through the host's page tables (ATS), so a
#   pageable copy comes much closer to a pinned one, while every pinned byte is still host memory
#   nobody else can use. vLLM's docstring for the switch names "unified-memory systems (e.g.
#   GH200)" (vLLM 0.29): in its words pinned memory "eats into GPU memory" there.
# - **No pinning available**: a CPU-only torch raises on `pin_memory=True`; vLLM gates it with
#   `is_pin_memory_available()` (WSL, CPU platforms).
#
# ## Zero-copy: the GPU reading pinned host memory
#
# vLLM's UVA offloader does not copy offloaded weights back: it hands the kernels a **CUDA view of
# the pinned host buffer** (`get_accelerator_view_from_cpu_tensor`, a custom C++ op calling
# `cudaHostGetDevicePointer` + `torch::from_blob`), and every kernel that reads the weight pulls it
# over PCIe. Torch has no public API for that view (no `Tensor.cuda_view()`). The closest public
# route is the `__cuda_array_interface__` protocol, which `torch.as_tensor` consumes without
# copying: hand it the pinned buffer's address, which on a 64-bit system with unified virtual
# addressing is also a valid device address for memory from `cudaHostAlloc`.


# %%
class _PinnedBuffer:
    """The pinned tensor's address, shape and type
    in the __cuda_array_interface__ protocol."""

    def __init__(self, t):
        self.keep = t  # the host memory must outlive the view
        self.__cuda_array_interface__ = {
            "data": (t.data_ptr(), False),
            "shape": tuple(t.shape),
            "typestr": "<i2",
            "strides": None,
            "version": 3,
        }


def uva_view(pinned):
    """A CUDA tensor that reads pinned host memory in place (bf16 travels as int16: the
    protocol has no bf16 type)."""
    if not pinned.is_pinned():
        raise ValueError(
            "a zero-copy view needs pinned memory (pageable pages may move)"
        )
    return torch.as_tensor(_PinnedBuffer(pinned.view(torch.int16)), device="cuda").view(
        pinned.dtype
    )


# %% [markdown]
# One 86 MiB weight in a matmul with 16 tokens (a decode step), three ways: resident in GPU
# memory; pinned on the host and **copied per use** (as a prefetching offloader does); read
# **zero-copy** through `uva_view`. If this torch cannot make the view, the error is recorded;
# copied per use is the closest alternative.

# %%
zc = pinlab.measure(
    "05_zero_copy",
    lambda **kw: wr.zero_copy_matmul(uva_view, **kw),
    hidden=wr.HIDDEN,
    inter=wr.INTER,
    tokens=16,
    repeat=10,
)
ways = zc["ways"]
z = ways["zero_copy"]
pinlab.show(
    "zero-copy view with this torch",
    "available" if z["available"] else f"not available: {z['error']}",
)
in_place = not z["available"] or (
    z["same_pointer_as_host"]
    and z["host_write_seen_by_gpu"]
    and z["same_output"]
    and z["view_equals_weight"]
)
pinlab.claim(
    "copied per use gives the resident output",
    ways["copied_per_use"]["same_output"],
    why=wr.WHY.same_bytes,
)
pinlab.claim(
    "where the zero-copy view exists, it has the host buffer's address, "
    "sees a host write at the next GPU read, and gives the resident output",
    in_place,
    why=wr.WHY.same_bytes,
)
for name, v in ways.items():
    if "ms" in v:
        pinlab.report(f"{name}: GPU time per use", v["ms"])
        pinlab.show(
            f"{name}: weight bytes / GPU time",
            f"{zc['bytes'] / (v['ms'] * 1e-3) / 1e9:.1f} GB/s",
        )

# %% [markdown]
# When the view exists: the CUDA tensor has the pinned buffer's own address (nothing copied); the
# next GPU kernel reads what the host wrote into the buffer (host memory read on every access);
# the matmul gives the resident result bit for bit. With 16 tokens the matmul is spent reading the
# weight, so weight bytes / GPU time is its read rate: from HBM (resident), by the copy engine over
# PCIe then from HBM (copied per use), or over PCIe by the kernel's own loads (zero-copy).
#
# Zero-copy trades GPU memory for PCIe traffic on *every* use: HBM serves a resident weight at
# terabytes per second, the link a zero-copy one at best at its rate (GPU loads of host memory
# often reach less than a copy engine). Copying per use is no cure: the copy waits in line before
# the matmul. Copying pays when done *ahead*: a prefetch (pinned, `non_blocking`) overlaps other
# work, and the copy is read from HBM as long as it stays. Zero-copy pays for rarely used weights,
# or when GPU memory is not there; on the hot path, prefetch or keep resident. The view needs
# **pinned** memory: vLLM's op quietly pins a pageable tensor first, one more reason for the PR
# to restore straight into pinned memory.

# %%
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    value=pinlab.pinned_bytes_held(),
    why=wr.WHY.pinned_back,
)

# %% [markdown]
# ## What to remember
# - Restore offloaded weights with **one copy straight into pinned memory**:
#   `torch.empty_like(w, device="cpu", pin_memory=pin).copy_(w)`. After `.to("cpu")` (pageable)
#   the next `non_blocking` reload can block the host; `.to("cpu").pin_memory()` copies twice.
# - Count copies and check that every weight comes back bitwise identical.
# - Warm, the pinned restore runs near the link's D2H peak; cold, it pays for page-locking.
# - The price: pinned host RAM, rounded up to powers of two per weight. Do not pin when RAM is
#   short or the footprint does not fit (`VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY`), for one-off
#   moves, or where pinning buys little (GH200/GB200: the GPU reads pageable memory over
#   NVLink-C2C; not measured here).
# - Zero-copy (UVA): kernels read pinned host memory in place, at PCIe speed on every use.
#
# **Exercises:** `exercises/05_pinned_weight_restore.ipynb` (solutions in `solutions/`).
