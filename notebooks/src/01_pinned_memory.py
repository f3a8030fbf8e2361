# %% [markdown]
# # 01 · Pinned memory
#
# **What you will learn**
# - what *pageable* and *page-locked* (pinned) host memory are, and why the GPU's copy engine cares;
# - H2D and D2H bandwidth, pinned against pageable, from 1 KiB to 1 GiB, measured here;
# - the latency floor of small copies;
# - what pinning costs: cold (`cudaHostAlloc`) against warm (PyTorch's caching host allocator);
# - that pinned blocks are rounded up to a power of two, and when *not* to pin.

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.lessons import l01_pinned_memory as bw
from pinlab.plots import bars, fmt_bytes, size_sweep

pinlab.header("01 pinned memory")
pinned_at_start = pinlab.pinned_baseline()

# %% [markdown]
# ## Two kinds of host memory
#
# Ordinary (*pageable*) memory belongs to the operating system: it may move a page, or swap it
# out, at any time. The GPU's copy engine reads host memory by physical address over PCIe, so it
# can only use memory that is guaranteed to stay put: **page-locked** (*pinned*) memory.
#
# So a copy from pageable memory takes two hops: the driver first copies your data into a pinned
# *staging* buffer of its own (a CPU `memcpy`), then the copy engine moves it. A copy from pinned
# memory takes one.
#
# ```
# pageable:  your tensor --CPU memcpy--> driver's pinned staging --DMA--> GPU
# pinned:    your tensor ---------------------------------------DMA--> GPU
# ```

# %% [markdown]
# In PyTorch, a CPU tensor is pageable unless you ask: `pin_memory=True` at creation, or
# `t.pin_memory()` (which returns a pinned *copy*). `is_pinned()` tells you which you have.

# %%
plain = torch.empty(1024)
print("torch.empty(...) is pinned:", plain.is_pinned())

# %% [markdown]
# Pinning needs a CUDA (or other accelerator) runtime: on a CPU-only torch, `pin_memory=True`
# raises. Code that must run everywhere gates it, as vLLM does with its `PIN_MEMORY` constant.

# %%
PIN_MEMORY = pinlab.has_cuda()
buf = torch.empty(1024, pin_memory=PIN_MEMORY)
print("pinned exactly when CUDA is available:", buf.is_pinned() == PIN_MEMORY)

# %% [markdown]
# ## Bandwidth, pinned against pageable
#
# 🔮 **Predict.** At 1 GiB, how much faster is a pinned H2D copy than a pageable one: the same,
# 2×, or more? And at 1 KiB?
#
# <details><summary>Answer</summary>
#
# At 1 GiB pinned is several times faster (the staging `memcpy` and the second hop cost a lot);
# at 1 KiB both are equally slow, because a tiny copy is all latency. Measure it below.
# </details>
#
# The sweep times one copy per size and direction with CUDA events (median of 5), from 1 KiB to
# 1 GiB. It needs about 3 GiB of host memory and 1 GiB on the GPU, and takes about 10 s.

# %%
sweep = pinlab.measure("01_bandwidth", bw.copy_bandwidth, sizes=bw.DEFAULT_SIZES, repeat=5)
rows = [{"bytes": r["bytes"], **{k[:-3]: bw.gbps(r["bytes"], r[k]) for k in r if k.endswith("_ms")}}
        for r in sweep.result]

# %% tags=["nbval-ignore-output"]
g = lambda v: f"{v:.2f}"  # noqa: E731
pinlab.table(rows, [("bytes", "size", fmt_bytes), ("h2d_pinned", "H2D pinned GB/s", g),
                    ("h2d_pageable", "H2D pageable GB/s", g), ("d2h_pinned", "D2H pinned GB/s", g),
                    ("d2h_pageable", "D2H pageable GB/s", g)])

# %%
sizes = [r["bytes"] for r in rows]
size_sweep(sizes, {k.replace("_", " "): [r[k] for r in rows]
                   for k in ("h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable")},
           ylabel="GB/s", title=f"Copy bandwidth ({sweep.tag})")
plt.show()

# %% [markdown]
# Read the plot from the right: at large sizes pinned copies run at the link's rate and pageable
# ones at a fraction of it. Now from the left: below about 64 KiB every line collapses together.

# %%
big = rows[-1]
pinlab.show("pinned / pageable H2D at " + fmt_bytes(big["bytes"]), f"{big['h2d_pinned'] / big['h2d_pageable']:.1f}x")
print("at the largest size, pinned H2D is at least 2x faster than pageable:",
      big["h2d_pinned"] >= 2 * big["h2d_pageable"])

# %% [markdown]
# ## Is the sweep honest? Compare with a plain copy loop
#
# A benchmark should reach what the hardware allows. The reference: a plain loop of back-to-back
# 256 MiB pinned copies, timed as a whole; the best of 3 trials.

# %%
peak = pinlab.measure("01_copy_loop_peak", bw.copy_loop_peak)
ratio = big["h2d_pinned"] / peak.result["best_GBps"]
pinlab.show("copy-loop peak", f"{peak.result['best_GBps']:.1f} GB/s")
pinlab.show("sweep's pinned H2D / copy-loop peak", f"{ratio:.3f}")
print("the sweep's pinned H2D reaches at least 95% of the copy-loop peak:", ratio >= 0.95)
assert ratio >= 0.95

# %% [markdown]
# ## The latency floor
#
# Plot time instead of bandwidth and the small copies show their nature: flat. Below some size
# a copy costs the same whatever it carries.

# %%
size_sweep(sizes, {"H2D pinned": [r["h2d_pinned_ms"] * 1e3 for r in sweep.result],
                   "H2D pageable": [r["h2d_pageable_ms"] * 1e3 for r in sweep.result]},
           ylabel="µs per copy (GPU time)", title=f"Time per copy ({sweep.tag})")
plt.show()

# %%
t = {r["bytes"]: r["h2d_pinned_ms"] for r in sweep.result}
floor_ms = min(t[s] for s in sizes if s <= 16 * bw.KiB)
pinlab.report("latency floor (smallest pinned H2D)", floor_ms)
print("1 KiB and 16 KiB copies cost within 2x of each other:", t[16 * bw.KiB] < 2 * t[bw.KiB])
print("a 1 KiB copy runs at under 1% of the peak rate:", rows[0]["h2d_pinned"] < 0.01 * peak.result["best_GBps"])

# %% [markdown]
# So batch small transfers: one 64 KiB copy costs about what one 1 KiB copy costs.
#
# ## What pinning costs
#
# 🔮 **Predict.** Getting 256 MiB of pinned memory: is it cheaper or dearer than copying 256 MiB
# from pageable memory to the GPU?
#
# The *first* pinned allocation of a size calls `cudaHostAlloc`, which page-locks every page: slow.
# PyTorch's **caching host allocator** keeps freed pinned blocks and hands them out again: a *warm*
# allocation costs almost nothing. `torch.cuda.host_memory_stats()` counts the `cudaHostAlloc`
# calls (`num_host_alloc`).

# %%
cost = pinlab.measure("01_pin_cost", bw.pin_cost)

# %% tags=["nbval-ignore-output"]
ms = pinlab.fmt_ms
pinlab.table(cost.result, [("bytes", "size", fmt_bytes), ("alloc_cold_ms", "cold alloc", ms),
                           ("alloc_warm_ms", "warm alloc", ms), ("pin_memory_cold_ms", "pin_memory() cold", ms),
                           ("h2d_pageable_ms", "pageable H2D", ms), ("h2d_pinned_ms", "pinned H2D", ms)])

# %%
print("every cold allocation called cudaHostAlloc:", all(r["alloc_cold_host_allocs"] >= 1 for r in cost.result))
print("no warm allocation called cudaHostAlloc:", all(r["alloc_warm_host_allocs"] == 0 for r in cost.result))

# %%
r = cost.result[-2]  # 256 MiB
labels = ["pageable H2D", "cold pin_memory() + H2D", "warm pin_memory() + H2D", "pinned H2D"]
values = [r["h2d_pageable_ms"], r["pin_memory_cold_ms"] + r["h2d_pinned_ms"],
          r["pin_memory_warm_ms"] + r["h2d_pinned_ms"], r["h2d_pinned_ms"]]
bars(labels, values, ylabel="host ms until the data is on the GPU",
     title=f"Moving {fmt_bytes(r['bytes'])} once ({cost.tag})", annotate="{:.1f}")
plt.show()

# %%
one_off = r["pin_memory_cold_ms"] + r["h2d_pinned_ms"]
pinlab.show(f"one-off {fmt_bytes(r['bytes'])}: cold pin + pinned copy vs pageable copy",
            f"{one_off:.1f} ms vs {r['h2d_pageable_ms']:.1f} ms "
            f"({'pinning loses' if one_off > r['h2d_pageable_ms'] else 'pinning wins'} here)")
pinlab.show(f"reused buffer {fmt_bytes(r['bytes'])}: warm pin + pinned copy vs pageable copy",
            f"{r['pin_memory_warm_ms'] + r['h2d_pinned_ms']:.1f} ms vs {r['h2d_pageable_ms']:.1f} ms")

# %% [markdown]
# Pinning pays when the pinned memory is **reused**: a warm block makes every later copy fast.
# Pinning a fresh buffer for a single copy can cost more than the pageable copy it replaces: the
# two lines above say which way it went on this machine.
#
# ## Pinned blocks are rounded up
#
# 🔮 **Predict.** You ask for 129.5 MiB of pinned memory. How much does the allocator page-lock?

# %%
rounding = pinlab.measure("01_rounding", bw.pinned_rounding)
req, got = rounding.result["request_bytes"], rounding.result["pinned_bytes_delta"]
pinlab.show("requested / pinned", f"{fmt_bytes(req)} / {fmt_bytes(got)}")
print("the request was rounded up to the next power of two:", got == pinlab.next_pow2(req))
print("released blocks go back to the driver:",
      rounding.result["held_after_release"] == rounding.result["held_before"])

# %% [markdown]
# Up to 2× the memory you asked for stays locked: vLLM users saw `--cpu-offload-gb` take about
# 1.9× the host memory requested for this reason (vLLM #56410).
#
# ## When *not* to pin
# - **One-off transfers** of big buffers: a cold pin can cost more than the pageable copy.
# - **Huge buffers**: rounding can double them, and pinned memory cannot be swapped out; pin
#   too much and the whole machine slows down or the process is killed.
# - **Where pinning is not available or not cheap**: CPU-only builds, WSL (vLLM gates it), and
#   unified-memory systems such as GH200, where pinned host memory eats into GPU memory (vLLM's
#   `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY`).

# %%
del buf
back = pinlab.pinned_back_to(pinned_at_start)
print("pinned memory held is back to its starting level:", back)
assert back

# %% [markdown]
# ## What to remember
# - The GPU's copy engine reads only pinned memory; pageable copies are staged by the driver.
# - Large copies: pinned runs at the link's rate, pageable at a fraction. Small copies: all latency.
# - Cold pinning is expensive, warm pinning (the caching host allocator) is cheap: pin buffers you **reuse**.
# - Pinned blocks are rounded to a power of two and cannot be swapped: do not pin everything.
#
# **Exercise:** `exercises/01_pinned_memory.ipynb` (solution in `solutions/`).
# **Next:** 02 · fake `non_blocking`.
