# %% [markdown]
# # Exercises · 03 The race
#
# Two small functions (one decode step's host→GPU metadata, a verdict on a timeline), then torch
# code: a step loop to make race-free without blocking the host. Write each where it says
# `YOUR CODE HERE`, then run the check cell below it. All of it runs on the CPU: without a GPU the
# third check uses the emulated lagging stream (`pinlab.LaggingStream`).
#
# ## What you will learn
# - one decode step's paged-KV metadata (`indptr`, `last_page_len`);
# - when a copy from a reused pinned buffer delivers its own step's data;
# - how to make a step loop race-free without blocking the host.

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
import matplotlib.pyplot as plt
import torch

import pinlab
from pinlab.checks import l03 as checks03
from pinlab import steploop
from pinlab.plots import timeline

# %% [markdown]
# ## 1. indptr and last_page_len
#
# Two arrays of the lesson's primer, which vLLM computes on the host every step:
# - `indptr` (B+1 ints): 0, then the running sum of the pages each request uses
#   (`ceil(seq_len / page_size)`);
# - `last_page_len` (B ints): the tokens in each request's last page (`page_size` when it is
#   full, 0 for an empty request).
#
# Example with `page_size=16`: `seq_lens [37, 48, 17, 0]` give `indptr [0, 3, 6, 8, 8]` and
# `last_page_len [5, 16, 1, 0]`.
#
# Write `indptr_last_page_len(seq_lens, page_size)` returning `(indptr, last_page_len)` as two
# lists of ints. *(5-8 lines)*


# %%
def indptr_last_page_len(seq_lens, page_size):
    ### BEGIN SOLUTION
    indptr, last = [0], []
    for n in seq_lens:
        pages = -(-n // page_size)
        indptr.append(indptr[-1] + pages)
        r = n % page_size
        last.append(page_size if (r == 0 and n > 0) else r)
    return indptr, last
    ### END SOLUTION


checks03.check_indptr_last_page_len(indptr_last_page_len)

# %% [markdown]
# ## 2. Did each copy read its own step?
#
# One reused pinned buffer. `writes[n] = (start, end)` is when the host wrote step n's data into
# it; `copies[n] = (start, end)` is when step n's DMA ran (reading the buffer). Copy n delivered
# step n's data only if **no later step's write starts before copy n ends** (a write starting
# exactly at its end is fine).
#
# A timeline from the lesson's model with `run_ahead=1` (**run-ahead k**: the host may write step
# n+k's data while the GPU has not yet run step n's copy): before writing step n the host waits
# for step n-2's copy, so step n-1's copy may still be queued:

# %%
sim = steploop.simulate("reused_pinned", steps=6, run_ahead=1)
timeline(
    {"host": sim["host"], "GPU": sim["gpu"]},
    title="One reused pinned buffer, run-ahead 1 (model)",
)
plt.show()
print("writes:", sim["writes"])
print("copies:", sim["copies"])

# %% [markdown]
# Write `copies_correct(writes, copies)` returning a list of booleans, one per step: True where
# copy n delivered step n's data. *(2-4 lines)*


# %%
def copies_correct(writes, copies):
    ### BEGIN SOLUTION
    return [
        all(writes[m][0] >= copies[n][1] for m in range(n + 1, len(writes)))
        for n in range(len(copies))
    ]
    ### END SOLUTION


checks03.check_copies_correct(copies_correct)

# %% [markdown]
# Compare with what the model says each copy delivered (-1 would mean a write was in progress):

# %%
try:
    print("your verdict:       ", copies_correct(sim["writes"], sim["copies"]))
except NotImplementedError:
    print("write copies_correct above first")
print("step each copy read:", sim["received"])


# %% [markdown]
# ## 3. Make the step loop race-free without blocking the host (torch code)
#
# The lesson's loop, as a function the checker drives. It gets the stream `s` and two functions:
# - `write_metadata(buf, n)`: the host writes step n's metadata (`N_INTS` int32) into the host
#   tensor `buf`;
# - `forward(n, meta)`: step n's forward on the GPU, which reads `meta` (step n's metadata in GPU
#   memory), then keeps the GPU busy. It returns once the GPU has read step n-`AHEAD`'s metadata,
#   as a real loop reading step n-`AHEAD`'s output would (the harness's wait, not yours): the
#   run-ahead is `AHEAD`.
#
# With one reused pinned buffer:

# %%
N_INTS, AHEAD = checks03.N_INTS, checks03.AHEAD


def racy_loop(s, steps, write_metadata, forward):
    buf = torch.zeros(N_INTS, dtype=torch.int32, pin_memory=True)
    for n in range(steps):
        write_metadata(buf, n)  # the host writes step n's metadata
        meta = torch.empty(N_INTS, dtype=torch.int32, device=s.device)
        meta.copy_(buf, non_blocking=True)  # the GPU reads buf when it gets there
        forward(n, meta)


run = checks03.run_loop(racy_loop, steps=100)
pinlab.show("ran on", run["label"])
pinlab.show(
    "steps that read another step's data", f"{run['wrong_steps']} of {run['steps']}"
)
# the harness keeps the GPU busy per step, far
# longer than the host needs: a wide lead on any GPU
pinlab.claim(
    "more than half the steps read another step's data",
    run["wrong_steps"] > run["steps"] // 2,
    value=f"{run['wrong_steps']} of {run['steps']}",
    why="the race needs the GPU behind the host; a host slower than the GPU's "
    "work per step (a CPU shared by many processes) lets the GPU keep up",
)

# %% [markdown]
# Write `race_free_loop(s, steps, write_metadata, forward)`: the same loop, in which **every step's
# forward reads its own metadata** and **the host never waits for the GPU** (`s.synchronize()` in
# every step fixes the race by blocking: the checker rejects it, as it does an event's
# `synchronize()` or a `query()` poll that finds the event not reached yet). Write a step's
# metadata first, then copy it with `non_blocking=True` from pinned memory. Two fixes from lesson
# 04 work: a fresh pinned snapshot per step, or a ring of pinned buffers guarded by events (how
# deep, for run-ahead `AHEAD`?).
#
# The checker runs 200 steps (on a GPU kept busy, so the host runs ahead), then says which step
# read whose data, or in how many steps the host waited, and why. *(6-8 lines)*


# %%
def race_free_loop(s, steps, write_metadata, forward):
    ### BEGIN SOLUTION
    buf = torch.zeros(N_INTS, dtype=torch.int32)  # pageable: the host writes here
    for n in range(steps):
        write_metadata(buf, n)
        snap = buf.pin_memory()  # step n's own pinned copy (a snapshot)
        meta = torch.empty(N_INTS, dtype=torch.int32, device=s.device)
        meta.copy_(snap, non_blocking=True)  # reads snap, which nobody rewrites
        forward(n, meta)
    ### END SOLUTION


checks03.check_race_free_loop(race_free_loop)

# %% [markdown]
# ## What to remember
# - A `non_blocking` copy from pinned memory reads the buffer when the GPU gets to it: rewrite it
#   before then and that step silently gets another step's data.
# - Whether copy n is safe depends on the *next writes* to its buffer, not on its own write.
# - Race-free without blocking: a fresh pinned snapshot per step (the caching host allocator keeps
#   it until its copy has run), or a ring of pinned buffers at least one deeper than the run-ahead,
#   guarded by events. `synchronize()` is race-free but blocks; `pin_memory()` of a pinned buffer
#   returns the same storage: no snapshot.
