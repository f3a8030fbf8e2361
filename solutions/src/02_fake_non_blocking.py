# %% [markdown]
# # Exercises · 02 Fake `non_blocking`
#
# Two small functions that turn the lesson's raw measurements into the numbers it prints. Write
# each one where it says `YOUR CODE HERE`, then run the check cell below it. No GPU needed.

# %%
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


ok = checks02.check_stall_threshold(stall_threshold)

# %% [markdown]
# ## 2. How idle was the GPU?
#
# From a profiler trace the lesson takes the kernels' `(start, end)` spans and asks: what share
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


ok = checks02.check_gpu_idle_share(gpu_idle_share)
