# %% [markdown]
# # Exercises · 04 The fix
#
# Three exercises: the two fixes of lesson 04 in torch (a snapshot that is really a copy, and a ring
# of pinned buffers guarded by events), then the arithmetic of the ring's depth. Write each where it
# says `YOUR CODE HERE`, then run the check cell below it.
#
# No GPU needed: without one, the first two checks run your code on the emulated lagging stream
# (`pinlab.LaggingStream`), where the GPU's copies wait in a queue until the host waits for them,
# so a copy reads its buffer exactly as late as a lagging GPU would. On a GPU they run on the CUDA
# stream, behind a busy GPU.
#
# ## What you will learn
# - why `t.pin_memory()` is not a snapshot when `t` is already pinned, and how to make one that is;
# - how events make a ring of pinned buffers safe, and what they cost when the ring is too shallow;
# - how deep the ring must be for a given run-ahead.

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

from pinlab.checks import l04 as checks04
from pinlab import steploop

# %% [markdown]
# ## 1. A snapshot that is really a copy
#
# `pin_snapshot(t)` returns a **pinned** copy of the host tensor `t` that the caller may rewrite `t`
# after (the step loop rewrites its buffer at the next step while the copy is still queued):
# - pinned memory, so that the `non_blocking` copy from it is a real asynchronous DMA;
# - its **own storage**, whatever `t` is: for a pageable `t`, `t.pin_memory()` copies; for an already
#   pinned `t` it returns `t` itself (the same storage: a no-op, the trap of lesson 04);
# - the same shape, dtype and values as `t`, bit for bit (non-contiguous, 0-d and empty `t` included).
#
# The check tries pageable and pinned tensors, then runs your function in a step loop that rewrites
# one pinned buffer every step for 200 steps with run-ahead 64 (the host may write step n+64's data
# while the GPU has not yet run step n's copy: more copies in flight than a pool of buffers you might
# recycle is deep), and copies `pin_snapshot(buf)` with `non_blocking=True`. *(1 line)*


# %%
def pin_snapshot(t):
    ### BEGIN SOLUTION
    return torch.empty_like(t, pin_memory=True).copy_(t)
    ### END SOLUTION


checks04.check_pin_snapshot(pin_snapshot)

# %% [markdown]
# ## 2. A ring of pinned buffers, guarded by events
#
# MRV2's buffer pools avoid the race without a snapshot per step: a ring of pinned buffers, step n
# writing buffer `n % depth`. Write the staging of one step, `ring_stage(n, data, ring, events, dst)`:
# - `ring`: the `depth` pinned buffers; `events[i]`: the event that guards `ring[i]`;
# - `data`: step n's host data; `dst`: step n's device memory;
# - before rewriting buffer `k = n % depth`, wait (`events[k].synchronize()`) for the event recorded
#   after the copy that last read it (an event never recorded returns at once); then write `data`
#   into it, copy it into `dst` with `non_blocking=True`, and record `events[k]`.
#
# The check runs 200 steps with run-ahead 4 (the host may write step n+4's data while the GPU has
# not yet run step n's copy), twice: with a ring of 5 buffers, run-ahead + 1 (every buffer's last
# copy has run by the time it comes round: the host must never wait)
# and with a ring of 2 (too shallow: the host must wait, not race). *(5 lines)*


# %%
def ring_stage(n, data, ring, events, dst):
    ### BEGIN SOLUTION
    k = n % len(ring)
    events[k].synchronize()  # the copy that last read ring[k] has run
    ring[k].copy_(data)  # the host writes step n
    dst.copy_(ring[k], non_blocking=True)  # the DMA reads ring[k] later
    events[k].record()  # completes when that copy has run
    ### END SOLUTION


checks04.check_ring_stage(ring_stage)

# %% [markdown]
# ## 3. How deep must the ring be?
#
# As in exercise 03: `writes[n] = (start, end)` is when the host wrote step n, `copies[n] =
# (start, end)` when the GPU's copy for step n ran. With a ring of `depth` pinned buffers, step n
# writes buffer `n % depth`, so the next write into the buffer copy n reads is step `n + depth`'s.
# The host's timing does not depend on which buffer it writes.
#
# Write `min_ring_depth(writes, copies)`: the smallest `depth` (at least 1) for which every copy
# delivers its own step's data, that is, for every n with `n + depth < steps`, the write of step
# `n + depth` starts no earlier than copy n ends. *(4-6 lines)*


# %%
def min_ring_depth(writes, copies):
    ### BEGIN SOLUTION
    steps = len(writes)
    depth = 1
    while any(writes[n + depth][0] < copies[n][1] for n in range(steps - depth)):
        depth += 1
    return depth
    ### END SOLUTION


checks04.check_min_ring_depth(min_ring_depth)

# %% [markdown]
# Check it against the model: find the depth for the model with `run_ahead=1` (before writing step n
# the host waits for step n-2's copy), then simulate a ring of that depth, and one buffer fewer. A
# ring for run-ahead k needs k + 1 buffers: the ring of exercise 2 (run-ahead 4) has 5, and exercise
# 03's harness (run-ahead `AHEAD` = 2) needs 3.

# %%
sim = steploop.simulate("reused_pinned", steps=8, run_ahead=1)
try:
    depth = min_ring_depth(sim["writes"], sim["copies"])
    enough = steploop.simulate("ring", steps=8, run_ahead=1, ring_depth=depth)
    print("depth needed:", depth)
    print(f"a ring of {depth}: corrupted copies:", enough["corrupted"])
    if depth > 1:
        short = steploop.simulate("ring", steps=8, run_ahead=1, ring_depth=depth - 1)
        print(f"a ring of {depth - 1}: corrupted copies:", short["corrupted"])
except NotImplementedError:
    print("write min_ring_depth above first")

# %% [markdown]
# ## What to remember
# - `pin_memory()` of a pinned tensor returns the same tensor: it is no snapshot. When the source may
#   be pinned already, allocate and copy: `torch.empty_like(t, pin_memory=True).copy_(t)`.
# - A snapshot must be new memory at every call: one reused by the next call is the same race, one step
#   later.
# - A ring of pinned buffers is safe when each buffer is rewritten only after the event recorded after
#   its last copy has completed. Record the event *after* the copy, and wait on that buffer's event,
#   not on the whole stream.
# - As deep as the steps in flight, the ring never waits; shallower, the events make the host wait
#   (correct, but the run-ahead is gone); without the events, it races.
