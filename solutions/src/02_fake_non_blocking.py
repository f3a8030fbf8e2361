# %% [markdown]
# # Exercises · 02 Fake `non_blocking`
#
# Two small functions that turn the lesson's raw measurements into the numbers it prints, then the
# torch code itself: a step with three hidden syncs to find and fix. Parts 1 and 3 need lesson 02,
# part 2 only the idea of lesson 02b's idle share, explained here. Write each one where it says
# `YOUR CODE HERE`, then run the check cell below it. No GPU needed: without one, the third check runs
# your code on the emulated lagging stream (`pinlab.LaggingStream`), which sees every time the host
# waits for queued GPU work, and every copy from pageable memory.
#
# ## What you will learn
# - how to tell from measurements from which size on a `non_blocking` copy from pageable memory waits;
# - how idle the GPU was, from the kernel spans of a trace;
# - how to find the three usual hidden syncs in a step (a large pageable copy, a GPU value read into
#   Python, a blocking copy back) and remove them without changing the result.

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

# %%
import torch

from pinlab.checks import l02 as checks02

# %% [markdown]
# ## 1. From which size on does a pageable copy wait?
#
# The lesson times one `copy_(..., non_blocking=True)` per size behind a GPU kept busy for
# `busy_ms`. A copy **waited** when its host time is *more than* half the busy time (exactly half
# is not waiting: the checker tries that boundary).
#
# `stall_threshold(sizes, host_ms, busy_ms)` returns the **smallest size from which on every
# larger size waited**, or `None` when the largest size did not wait. `host_ms[i]` belongs to
# `sizes[i]`; the sizes come in any order. Why not simply "the first size that waited"? One
# stray slow measurement among small copies (the OS paused the process) would fool it. *(4-6 lines)*


# %%
def stall_threshold(sizes, host_ms, busy_ms):
    ### BEGIN SOLUTION
    threshold = None
    for size, ms in sorted(zip(sizes, host_ms), reverse=True):
        if ms <= busy_ms / 2:
            break
        threshold = size
    return threshold
    ### END SOLUTION


checks02.check_stall_threshold(stall_threshold)

# %% [markdown]
# ## 2. How idle was the GPU?
#
# From a profiler trace lesson 02b takes the kernels' `(start, end)` spans and asks: what share
# of a window `[start, end]` did the GPU spend with **no** kernel running?
#
# `gpu_idle_share(spans, start, end)` returns that share, from 0 (always busy) to 1 (never
# busy). Spans may overlap (count the overlap once), touch (one ends where the next starts: lose
# neither), come in any order, and stick out of the window (count only the part inside it). The
# lesson's own answer is `pinlab.profiler.idle_share`; write yours without it. *(8-12 lines: clip,
# sort, merge, sum)*


# %%
def gpu_idle_share(spans, start, end):
    ### BEGIN SOLUTION
    busy, current = 0.0, None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a:
            continue  # empty, or outside the window
        if current is None or a > current[1]:
            if current is not None:
                busy += current[1] - current[0]
            current = [a, b]
        else:
            current[1] = max(current[1], b)
    if current is not None:
        busy += current[1] - current[0]
    return 1.0 - busy / (end - start)
    ### END SOLUTION


checks02.check_gpu_idle_share(gpu_idle_share)


# %% [markdown]
# ## 3. Find and fix the hidden syncs (torch code)
#
# A step of an inference loop, as it is often first written. `x_host` is a batch of activations in
# host memory (pageable, a few MiB), `w` a weight on the GPU; the step scales the rows by their
# largest magnitude, projects them, and hands the scores back to the host (they are there when it
# returns, so it returns no event). It is correct, and it makes the host wait for the GPU **three
# times**, in three different ways from this lesson:


# %%
def step_with_syncs(s, x_host, w):
    x = x_host.to(s.device, non_blocking=True)
    scale = x.abs().max().item()
    scores = (x / scale) @ w
    return scores.cpu(), None


# %% [markdown]
# Write `step_without_syncs(s, x_host, w)`: the same scores, with **no** host wait. It returns
# `(scores_host, done)`: `scores_host` a tensor in host memory, `done` an event (`s.Event()`)
# recorded after the copy into it. The caller reads `scores_host` only after `done.synchronize()`,
# so the host is free until it really needs the numbers (your step waits on it neither with
# `done.synchronize()` nor with a loop polling `done.query()`: both are host waits).
# - every copy to the GPU is `non_blocking=True` from **pinned** memory;
# - no value of a GPU tensor is read into Python (`.item()`, `.tolist()`, `if t:`, `int(t)`);
# - the scores come back with a `non_blocking=True` copy into pinned memory.
#
# The checker keeps the GPU busy with a long kernel and runs your step for inputs of three sizes: on a
# GPU a step that waits takes as long as the kernel, and `pinlab.detect_stalls` names the call; without
# one, the lagging stream records each wait and the call that made it. Try `step_with_syncs` in
# the checker first if you like: it names one sync at a time. `x_host.pin_memory()` is a fine way to
# stage here (a host memcpy into a fresh pinned block); a loop that keeps one pinned buffer instead
# must not rewrite it before its copy has run: that is lesson 03. *(7-9 lines)*


# %%
def step_without_syncs(s, x_host, w):
    ### BEGIN SOLUTION
    # pinned staging: the copy is really queued
    x = x_host.pin_memory().to(s.device, non_blocking=True)
    scale = x.abs().max()  # stays on the GPU (a 0-dim tensor)
    scores = (x / scale) @ w
    out = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
    out.copy_(scores, non_blocking=True)  # device to host, queued behind the kernels
    done = s.Event()
    done.record()  # reached once `out` holds the scores
    return out, done
    ### END SOLUTION


checks02.check_step_without_syncs(step_without_syncs)

# %% [markdown]
# ## What to remember
# - A copy waited when the host spent more than half the GPU's busy time in it; judge it from the
#   largest size down, so one stray slow measurement does not decide.
# - An idle share comes from the union of the kernel spans inside the window: merge overlaps, clip the
#   edges.
# - `non_blocking=True` from **pageable** memory is only as asynchronous as the driver's staging: a small
#   copy it stages returns at once (the host pays the staging `memcpy`), a large one waits for the GPU: the
#   fake `non_blocking` (where the line falls is the driver's choice, undocumented; on ROCm every pageable
#   copy waits). Stage through pinned memory (`x.pin_memory()`, or a pinned buffer you keep).
# - `.item()`, `.tolist()`, `if t:`, `int(t)` and a blocking `.cpu()` each wait for every kernel queued
#   before them. Keep values on the GPU; bring results back into pinned memory with `non_blocking=True`
#   and read them after an event.
# - On a GPU, `pinlab.detect_stalls` names each of these calls in your own code.
