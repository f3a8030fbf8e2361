# %% [markdown]
# # 06 · Build indices on the device: rotary position ids without an H2D copy
#
# **What you will learn**
# - how Qwen2-VL numbers its vision tokens (rotary position ids), and three ways to build them:
#   (a) on the CPU, then a copy; (b) on the device, one image at a time (the vLLM 0.29 PR);
#   (c) on the device, all images at once;
# - that all three give **exactly** the same ids and embeddings (checked here, on any machine);
# - why removing a copy can make things *slower*: one launch chain per image;
# - how to count kernel launches and H2D copies with `torch.profiler`, and how to choose a builder
#   per batch;
# - the other copies the PR removed: a streaming audio mask built on the device, and per-step
#   results copied back into pinned memory, read only after their event.

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
import inspect
import random

import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l06_device_side_indices as l06
from pinlab.plots import bars

pinlab.header("06 device-side indices")
pinned_at_start = pinlab.pinned_baseline()
GPU = pinlab.has_cuda()

# %% [markdown]
# ## Positions for vision tokens
#
# Qwen2-VL cuts an image into `h × w` patches (a video into `t` frames of them) and gives each
# patch a 2-D rotary position: its (row, column). Neighbouring `m × m` patches are later merged
# into one token (`m`, the *spatial merge size*, is 2), so the patches are ordered **block by
# block**: the `m × m` patches of merge block (0, 0) first, row-major inside the block, then
# block (0, 1), and so on. Every frame of a video repeats the same positions. For patch `k` of a
# frame:
#
# `b = k // m²`, `r = k % m²`, `row = (b // (w/m))·m + r // m`, `col = (b % (w/m))·m + r % m`.
#
# The rotary table holds `cos`/`sin` per position; the embeddings of the batch are the gather
# `cos[pos_ids].flatten(1)` (the row's frequencies, then the column's).

# %%
ids = l06.ids_before([[1, 4, 6]], 2, "cpu")
first12 = [tuple(p) for p in ids[:12].tolist()]
print("first 12 (row, col) of a 4x6 image, m=2:")
print(" ", first12)
BLOCK_ORDER = [
    (0, 0),
    (0, 1),
    (1, 0),
    (1, 1),  # merge block (0, 0), row-major inside it
    (0, 2),
    (0, 3),
    (1, 2),
    (1, 3),  # block (0, 1)
    (0, 4),
    (0, 5),
    (1, 4),
    (1, 5),
]  # block (0, 2)
pinlab.claim(
    "block by block, row-major inside each 2x2 block",
    first12 == BLOCK_ORDER,
    why=l06.WHY.cpu_ints,
)

# %% [markdown]
# ## Three ways to build them
#
# The code below is the library's (`pinlab.lessons.l06_device_side_indices`), printed so that you
# can read and copy it; every experiment in this notebook runs exactly these functions.
#
# **(a) before** (vLLM 0.28): built on the CPU, image by image, then one
# `.to(cos.device, non_blocking=True)` from pageable memory (`docs/facts.md` F12). HF transformers
# 4.x builds the same ids on the CPU too, but makes no copy of its own: it indexes the GPU table
# with the CPU index tensor and leaves moving the index to torch (F13). For ids this small (a few
# hundred KiB at most here) the driver first copies them into a pinned staging buffer of its own, and the call
# usually returns without waiting for the GPU: the host pays for the staging on every call, and
# once the driver's staging pool is full the same call waits for the GPU (lesson 02 measures when:
# then it is lesson 02's fake `non_blocking`). That is undocumented driver behaviour: the CUDA
# Runtime API's "API synchronization behavior" page
# (https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html) says only that a copy from
# pageable memory may be synchronous. So (a)'s copy is staged and usually returns at once, at a host
# cost on every call, and only as long as the driver has room.

# %%
print(inspect.getsource(l06.ids_before))

# %% [markdown]
# **(b) the PR** (vLLM 0.29): the same chain, built on the device. For Qwen2-VL, vLLM 0.29 builds
# the ids with `device=self.device` (the patch embedding's device) and calls `get_cos_sin` after the
# loop; the `torch.arange(..., device=cos.device)` form, with `get_cos_sin` first, is Qwen2.5-VL's
# (`docs/facts.md` F12). No copy at all; but every image launches its own chain of small kernels.

# %%
print(inspect.getsource(l06.ids_per_image))

# %% [markdown]
# **(c) beyond the PR**: one construction for every image. The host knows the grid, so it makes
# a tiny table with one row per image (its token count, where its tokens start, `h·w`, `w/m`) and
# copies it **once**, pinned and `non_blocking` (`pinlab.async_tensor_h2d`). On the device,
# `repeat_interleave(..., output_size=N)` gives every token its image's row (the host passes `N`,
# so torch need not read the counts back: no sync), and the closed form does the rest. The
# number of torch calls does not depend on the number of images (inside `repeat_interleave`,
# torch may launch a kernel or two more for a table of several rows than for one).

# %%
print(inspect.getsource(l06.ids_vectorised))
print(inspect.getsource(l06.to_device_once))

# %% [markdown]
# And the gather, shared by all three (cos/sin first, as the PR does in Qwen2.5-VL, then the ids on
# `cos.device`):

# %%
print(inspect.getsource(l06.rot_pos_emb))

# %% [markdown]
# ## Are they really equal?
#
# A fourth builder joins the three from here on: the **recommended** one, `(rec)` in the printed
# lines, which runs (b) for a batch of one image or video and (c) for more (its code, and why,
# further down).
#
# Random batches: 1 to 32 images and videos mixed, `t` in 1..4, `h` and `w` multiples of `m`,
# merge sizes 1, 2 and 4. Exact equality of the ids (`torch.equal`) and of the embeddings, on the
# CPU here (and on the GPU too where there is one). The tests (`tests/test_l06.py`) run the same
# property with `hypothesis` over sides up to 128.

# %%
rng = random.Random(6)
batches = [
    (l06.random_grid(rng, m, max_images=32, max_side=64), m) for m in (1, 2, 2, 4) * 3
]
devices = ["cpu"] + (["cuda"] if GPU else [])
results = [
    l06.equivalent(grid, m, l06.VisionRotary(80, device=d))
    for d in devices
    for grid, m in batches
]
print(f"(a), (b), (c) and the recommended builder on {len(batches)} random batches:")
pinlab.claim("equal ids", all(r["ids_equal"] for r in results), why=l06.WHY.exact)
pinlab.claim(
    "equal embeddings", all(r["emb_equal"] for r in results), why=l06.WHY.exact
)
pinlab.claim("int64 ids", all(r["dtype_int64"] for r in results), why=l06.WHY.exact)

# %% [markdown]
# Bad input gets an error that names the argument:

# %%
for bad in ([[1, 15, 16]], [], torch.tensor([[1.0, 4.0, 4.0]]), [[1, 4]]):
    try:
        l06.ids_vectorised(bad, 2, "cpu")
    except (TypeError, ValueError) as exc:
        print(pinlab.timing.wrapped(f"{type(exc).__name__}: {exc}"))
try:
    l06.ids_vectorised([[1, 4, 4]], 2, 0)
except TypeError as exc:
    print(pinlab.timing.wrapped(f"{type(exc).__name__}: {exc}"))

# %% [markdown]
# ## Torch calls grow with the images in (a) and (b), not in (c)
#
# 🔮 **Predict.** For 32 small images (16 × 16 patches each), which builder costs the host the
# least: (a), (b) or (c)? And for one large image?
#
# <details><summary>Answer</summary>
#
# For 32 small images (c), by a wide margin: (a) and (b) run one chain of about fourteen torch
# calls *per image*, and on a GPU a third or so of (b)'s calls launch a kernel (views such as
# `expand`, `reshape` or `permute` launch none), each launch costing the host a fixed price whatever
# the kernel's size. For one large image (b) usually wins: its single chain
# is short, and (c) pays a fixed cost (the table, its copy, `repeat_interleave`). (a) pays for
# its per-image chain on the CPU and for its pageable copy. Measure it below.
# </details>
#
# First, without any GPU: count the torch calls each builder makes (a `TorchFunctionMode` sees
# every call; on a GPU, not every call on device tensors launches a kernel: a view such as
# `expand`, `reshape`, `permute` or `flatten` of a contiguous tensor launches none, so for (a) and (b)
# the profiler below counts far fewer kernels than torch calls; its counts also include the cos/sin
# gather, which the count of calls leaves out, so (c) shows about as many kernels as calls).

# %%
calls = {
    n: {
        k: l06.count_calls(f, [[1, 16, 16]] * n, 2, "cpu").calls
        for k, f in l06.BUILDERS.items()
    }
    for n in (1, 8, 32)
}
for n, row in calls.items():
    pinlab.show(f"torch calls for {n:2d} small images", l06.per_builder(row, "{}"))
c_flat = calls[1]["c"] == calls[8]["c"] == calls[32]["c"]
ab_grow = calls[32]["a"] >= 3 * calls[8]["a"] and calls[32]["b"] >= 3 * calls[8]["b"]
pinlab.claim(
    "(c) makes the same number of torch calls for 1, 8 and 32 images",
    c_flat,
    value=[calls[n]["c"] for n in calls],
    why=l06.WHY.counted,
)
pinlab.claim(
    "(a) and (b) make at least 3x as many calls for 32 images as for 8",
    ab_grow,
    why=l06.WHY.counted,
)

# %% [markdown]
# On the GPU, `torch.profiler` counts what really happened in one call of each builder (ids and
# the cos/sin gather): kernels run, kernel launch calls, and the H2D copies by name:
# `Memcpy HtoD (Pageable -> Device)` or `(Pinned -> Device)`. The grid mixes: one large image, one
# video, 8 and 32 small images, and a mixed batch of images and a video. (a)'s per-image calls
# run on the CPU, so on the GPU it launches only its copy and the gather, whatever the mix: its
# per-image cost is CPU work. Where the profiler records no GPU activity (often so under WSL2, not
# measured here: `docs/facts.md` F18), this experiment replays the recorded run instead, and its
# `source` line says why.

# %%
mixes = {name: grid for name, grid in l06.MIXES.items()}
launches = pinlab.measure("06_launches", l06.launch_counts, mixes=mixes, merge_size=2)
lc = launches.result["mixes"]

# %% tags=["nbval-ignore-output"]
rows = [
    {
        "mix": mix,
        "builder": l06.LABELS[k],
        **lc[mix][k],
        "h2d": ", ".join(lc[mix][k]["h2d"]) or "none",
    }
    for mix in lc
    for k in l06.BUILDERS
]
pinlab.table(rows, l06.LAUNCH_COLUMNS)

# %%
small8, small32 = lc["8 small images"], lc["32 small images"]
b_none = all(not lc[m]["b"]["h2d"] for m in lc)
c_one_pinned = all(
    len(lc[m]["c"]["h2d"]) <= 1 and all("Pinned" in h for h in lc[m]["c"]["h2d"])
    for m in lc
)
a_pageable = all(any("Pageable" in h for h in lc[m]["a"]["h2d"]) for m in lc)
kernels_grow = (
    small32["b"]["kernels"] >= 3 * small8["b"]["kernels"]
    and small32["c"]["kernels"] <= small8["c"]["kernels"] + 2
)
pinlab.claim("(b) makes no H2D copy on any mix", b_none, why=l06.WHY.profiler)
pinlab.claim(
    "(c) makes at most one H2D copy, from pinned memory",
    c_one_pinned,
    why=l06.WHY.profiler,
)
pinlab.claim(
    "(a) copies its ids from pageable memory", a_pageable, why=l06.WHY.profiler
)
pinlab.claim(
    "from 8 to 32 small images, (b) runs at "
    "least 3x as many kernels, (c) at most 2 more",
    kernels_grow,
    why=l06.WHY.profiler,
)

# %%
for mix in ("32 small images", "one large image"):
    pinlab.show(
        f"kernels at {mix}",
        l06.per_builder({k: lc[mix][k]["kernels"] for k in l06.BUILDERS}, "{}"),
    )

# %% [markdown]
# ## What it costs the host, and end to end
#
# Two times per builder and mix, the builders interleaved round by round (median of 12 rounds),
# every kernel warmed up first (a first launch loads its module lazily and blocks), each host
# time taken right after the same builder's end-to-end call, as an engine calls one builder
# step after step:
# - **host time**: the GPU is kept busy ahead, as in a running engine, so the builder's kernels
#   are only queued; this is what the builder costs the CPU thread that feeds the GPU, including
#   any wait its pageable copy makes ((a)'s: whether it waits is the driver's choice, lesson 02);
# - **end-to-end time**: the GPU idle, the call, then a synchronize: how long until the
#   embeddings are there.

# %%
times = pinlab.measure(
    "06_builder_times",
    l06.builder_times,
    mixes=mixes,
    merge_size=2,
    rounds=12,
    busy_ms=6.0,
)
bt = times.result["mixes"]

# %% tags=["nbval-ignore-output"]
rows = [
    {
        "mix": m,
        "tokens": bt[m]["tokens"],
        **{
            f"{k}_{f}": bt[m][k][f] for k in l06.BUILDERS for f in ("host_us", "e2e_us")
        },
    }
    for m in bt
]
pinlab.table(rows, l06.TIME_COLUMNS)

# %%
fig, axes = pinlab.plots.stacked(2, height=3.4)
l06.plot_by_mix(
    {m: {k: bt[m][k]["host_us"] for k in l06.BUILDERS} for m in bt},
    ylabel="host µs per call",
    title=f"Host time, GPU busy ahead ({times.tag})",
    ax=axes[0],
)
l06.plot_by_mix(
    {m: {k: bt[m][k]["e2e_us"] for k in l06.BUILDERS} for m in bt},
    ylabel="µs until ready",
    title=f"End to end, GPU idle ({times.tag})",
    ax=axes[1],
)
plt.tight_layout()
plt.show()

# %%
for m in bt:
    r = l06.ratios_to_best(bt[m])
    pinlab.show(f"{m}: host time / best of (a), (b), (c)", l06.per_builder(r))
s32 = {k: v["host_us"] for k, v in bt["32 small images"].items() if k in l06.BUILDERS}
pinlab.show(
    "32 small images: (a) / (c) and (b) / (c) host time",
    f"{s32['a'] / s32['c']:.1f}x and {s32['b'] / s32['c']:.1f}x",
)
s8 = bt["8 small images"]
pinlab.show(
    "8 small images: (b) / (a) host time",
    f"{s8['b']['host_us'] / s8['a']['host_us']:.2f}",
)
worst = max(l06.ratios_to_best(bt[m])["rec"] for m in bt)
pinlab.observe(
    "the recommended builder came within 10% of the best of the three on every mix",
    worst <= 1.10,
    value=f"worst ratio {worst:.2f}",
    why=l06.WHY.rec_noise,
)
cheapest = {m: min("abc", key=lambda k: bt[m][k]["host_us"]) for m in bt}
pinlab.show(
    "what this run shows",
    "cheapest on the host: " + ", ".join(f"{m} ({k})" for m, k in cheapest.items()),
)

# %% [markdown]
# Read the ratios above (1.00 is the best of the three on that mix):
#
# - **Why (b) can be slower than (a) for many small images.** (a) runs its per-image chain on the
#   CPU: about fourteen tiny tensor operations on a few hundred elements each, then one copy. (b) runs
#   the same chain on the GPU: every operation that is not a view launches a kernel, and each
#   launch costs the host its fixed price (argument checks, the dispatcher, the driver call)
#   whatever the size of the kernel. Eight 16 × 16 images are one launch chain each; the GPU does almost nothing in them,
#   and the host spends its time launching. Removing the copy traded one copy for a launch chain
#   per image (the kernel counts above).
# - **Why (c) can win when there are many images:** its launches do not grow with the images (see
#   the counts above), and its one copy is a table of 32 bytes per image, from pinned memory.
# - **Why (b) can win for one large image or one video:** one chain is all it launches, and it
#   has no table to build, pin and copy; (c)'s fixed cost is larger than one chain.
#
# The `what this run shows` line says which builder was cheapest on each mix in this run. The
# recommended builder chooses per batch: (b) for a batch of one image or video, (c) for more
# (`PER_IMAGE_MAX`). (b)'s host cost grows with every image while (c)'s stays about flat, so at
# some number of images they cross; these mixes do not measure where: time a few small batches on
# your machine before you move the threshold. The observed line above says how close the
# recommended builder came to the best of the three on every mix in this run (the goal: within
# 10%). It runs the same code as the builder it chose, timed separately, so its ratio also shows
# how much the same code varies from one timing to the next (it can read below 1.00).

# %%
print(inspect.getsource(l06.ids_recommended))

# %% [markdown]
# ## In a step loop: does the GPU wait for the host?
#
# An encoder step loop as an engine runs it: before step n the host waits for step n-2's event
# (the run-ahead is bounded, as a batch queue bounds it), builds the rotary embeddings, and
# launches a 1 ms "encoder" kernel. With the run-ahead bounded, a step cannot take less than the
# longer of the two: the host's work for it, or the GPU's. When building takes the host longer than
# the encoder takes the GPU, the GPU waits for the host between encoders. 100 steps per builder and
# mix; each figure is the median over the steps after the run-ahead has filled (a single slow step,
# the OS taking the CPU away for a moment, does not move it).

# %%
loop = pinlab.measure(
    "06_step_loop",
    l06.builder_step_loop,
    mixes=mixes,
    merge_size=2,
    steps=100,
    warm_steps=5,
    encoder_ms=1.0,
    in_flight=2,
)
sl = loop.result["mixes"]
enc = loop.result["encoder_ms"]

# %%
fig, axes = pinlab.plots.stacked(2, height=3.4)
l06.plot_by_mix(
    {m: {k: sl[m][k]["ms_per_step"] for k in l06.BUILDERS} for m in sl},
    ylabel="ms per step",
    title=f"Step time, 1 ms encoder ({loop.tag})",
    ax=axes[0],
    logy=False,
)
l06.plot_by_mix(
    {m: {k: sl[m][k]["gpu_idle_share"] for k in l06.BUILDERS} for m in sl},
    ylabel="share of GPU time outside the encoder",
    title=f"GPU idle ({loop.tag})",
    ax=axes[1],
    logy=False,
)
plt.tight_layout()
plt.show()

# %%
for m in ("8 small images", "32 small images", "one large image"):
    for field, what in (
        ("ms_per_step", "ms per step"),
        ("build_ms", "host ms to build"),
        ("idle_ms", "GPU idle ms between encoders"),
    ):
        if sl[m]["a"][field] is not None:
            pinlab.show(
                f"{m}: {what}",
                l06.per_builder({k: sl[m][k][field] for k in l06.BUILDERS}),
            )
slow = [
    (m, k)
    for m in sl
    for k in l06.BUILDERS
    if sl[m][k]["build_ms"] > enc and sl[m][k]["idle_ms"] is not None
]
if slow:
    gaps = {
        f"{m} ({k})": (sl[m][k]["idle_ms"], sl[m][k]["build_ms"] - enc) for m, k in slow
    }
    idled_the_difference = all(
        abs(idle - diff) <= max(0.3, 0.3 * diff) for idle, diff in gaps.values()
    )
    detail = "; ".join(
        f"{name}: idle {idle:.2f} ms, build - encoder {diff:.2f} ms"
        for name, (idle, diff) in gaps.items()
    )
    pinlab.observe(
        f"where the build took the host longer than the {enc:g} ms encoder, "
        "the GPU idled about the difference every step (within 0.3 ms or 30%)",
        idled_the_difference,
        value=detail,
        why=l06.WHY.host_gaps,
    )
else:
    pinlab.show(
        "what this run shows",
        f"no builder took the host longer than the {enc:g} ms "
        "encoder on any mix: the GPU did not wait for the builders",
    )

# %% [markdown]
# With a 1 ms encoder and the run-ahead bounded, a builder that costs the host more than the
# encoder costs the GPU sets the pace: a step takes at least the host's time. On a host and a GPU
# of its own, the GPU then waits between encoders for about the difference; other processes add
# gaps of their own. The `[measured]` lines above list such builders, if this run had any, and say
# whether the GPU idled about the difference here. A builder cheaper than
# the encoder leaves the GPU only the gaps of its own small kernels and of the encoder's launch.
# (The idle figures count the small id kernels as "outside the encoder"; they take microseconds.)
#
# ## The other copies the PR removed
#
# ### A streaming attention mask (Phi-4-MM's audio encoder)
#
# Phi-4-MM's audio encoder attends in chunks: frame i may see the frames of its own chunk and of
# `left_window` chunks before it. The model builds this `[x_len, x_len]` mask on the CPU
# (`adaptive_enc_mask`, with a `nonzero()`), then moves it to the GPU; the PR made that move
# asynchronous with `async_tensor_h2d`. The mask depends only on shapes, so it can also be built
# on the device, in six launches and no copy (note that the CPU code's `nonzero()` would be a
# host sync on the GPU: the device version needs none).

# %%
print(inspect.getsource(l06.streaming_mask_device))
rng = random.Random(60)
cases = [
    (
        rng.randint(1, 200),
        rng.choice([1, 4, 16, 25]),
        rng.randint(0, 4),
        rng.randint(0, 2),
    )
    for _ in range(40)
]
same = all(
    torch.equal(l06.adaptive_enc_mask(*c), l06.streaming_mask_device(*c, "cpu"))
    for c in cases
)
pinlab.claim(
    f"the device-built mask equals Phi-4-MM's on {len(cases)} random shapes",
    same,
    why=l06.WHY.mask_ints,
)

# %%
mask = pinlab.measure(
    "06_mask_times",
    l06.mask_times,
    x_len=750,
    chunk_size=16,
    left_window=3,
    right_window=0,
    rounds=12,
    busy_ms=6.0,
)
pinlab.claim("the three masks are equal", mask.result["equal"], why=l06.WHY.mask_copy)
forms = mask.result["forms"]
bars(
    [l06.MASK_FORMS[k] for k in forms],
    [forms[k]["host_us"] for k in forms],
    ylabel="host µs per call",
    title=f"A {mask.result['bytes'] // 1024} KiB "
    f"streaming mask onto the GPU ({mask.tag})",
    annotate="{:.0f}",
)
plt.show()
for k in forms:
    pinlab.report(f"mask: {l06.MASK_FORMS[k]}", forms[k]["host_us"] / 1e3)

# %% [markdown]
# ### Per-step results back to the host: pinned, and read only after the event
#
# The other direction: each step computes a small result on the GPU (sampled tokens, logprobs)
# that the host needs later. vLLM creates its logprobs output tensors **pinned**, so that the
# device-to-host copy with `non_blocking=True` is truly asynchronous. But then the data is valid
# only once the copy has *run*: read it after the step's event, never right after the call.
#
# The loop below runs on the stream `pinlab.stream()` gives: the CUDA stream on a GPU, the
# emulated lagging stream on a CPU (the GPU far behind the host, labelled "emulated").


# %%
def per_step_results(s, steps=8, width=4, read_early=False):
    """Each step's result goes D2H into a fresh pinned
    buffer; returns how many steps read wrong data."""
    base = torch.arange(width, device=s.device)
    out = torch.empty(steps, width, dtype=torch.int64, device=s.device)
    pending, wrong = [], 0
    for n in range(steps):
        s.busy(2.0)  # the step's forward
        torch.add(base, 1000 * (n + 1), out=out[n])  # its result, on the GPU
        host = torch.empty(width, dtype=torch.int64, pin_memory=True)
        host.copy_(out[n], non_blocking=True)  # queued: returns at once
        ev = s.Event()
        ev.record()
        if read_early:
            # WRONG: too early
            wrong += host.tolist() != list(
                range(1000 * (n + 1), 1000 * (n + 1) + width)
            )
            continue
        pending.append((n, host, ev))
        if len(pending) > 1:  # read step n-1 while step n runs
            m, h, e = pending.pop(0)
            e.synchronize()  # wait for that step's copy only
            wrong += h.tolist() != list(range(1000 * (m + 1), 1000 * (m + 1) + width))
    for m, h, e in pending:
        e.synchronize()
        wrong += h.tolist() != list(range(1000 * (m + 1), 1000 * (m + 1) + width))
    s.synchronize()
    return wrong


with pinlab.stream() as s:
    pinlab.show("stream", s.label)
    early = per_step_results(s, read_early=True)
    after_event = per_step_results(s)
pinlab.claim(
    "read right after the copy call: some steps read wrong data",
    early > 0,
    value=early,
    why=l06.WHY.gpu_lead,
)
pinlab.claim(
    "read after the step's event: every step read its own data",
    after_event == 0,
    value=after_event,
    why=l06.WHY.event,
)

# %%
del ids, results
pinlab.claim(
    "pinned memory held is back to its starting level",
    pinlab.pinned_back_to(pinned_at_start),
    value=pinlab.pinned_bytes_held(),
    why=pinlab.PINNED_BACK_WHY,
)

# %% [markdown]
# ## What to remember
# - Indices that depend only on shapes (rotary position ids, masks) can be **built on the device**:
#   no host tensor, no copy, nothing for the driver to stage.
# - Removing a copy is not free: a **per-image chain of launches** costs the host a fixed price
#   per kernel, and can be slower than the CPU build it replaced. Count launches with
#   `torch.profiler` (or the torch calls with a `TorchFunctionMode`, on any machine).
# - Build for **all images at once**: one tiny table, copied once (pinned, `non_blocking`), then a
#   fixed number of launches; give torch the sizes the host knows (`output_size=`) so that nothing
#   is read back.
# - Choose per batch and measure: the vectorised form has a fixed cost that one image does not repay.
# - A D2H result goes into **pinned** memory with `non_blocking=True` and is valid only after its
#   **event**.
#
# **Exercises:** `exercises/06_device_side_indices.ipynb` (solutions in `solutions/`).
