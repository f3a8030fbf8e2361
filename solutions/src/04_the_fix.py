# %% [markdown]
# # Exercises · 04 The fix
#
# MRV2's buffer pools avoid the race without a snapshot per step: a ring of pinned buffers, step n
# writing buffer `n % depth`. How deep must the ring be? Everything here runs on the CPU.

# %%
from pinlab.checks import l04 as checks04
from pinlab import steploop

# %% [markdown]
# ## How deep must the ring be?
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


ok = checks04.check_min_ring_depth(min_ring_depth)

# %% [markdown]
# Check it against the model: find the depth for a host that runs up to two steps ahead, then
# simulate a ring of that depth, and one buffer fewer.

# %%
sim = steploop.simulate("reused_pinned", steps=8, ahead=2)
try:
    depth = min_ring_depth(sim["writes"], sim["copies"])
    enough = steploop.simulate("ring", steps=8, ahead=2, ring_depth=depth)
    print("depth needed:", depth)
    print(f"a ring of {depth}: corrupted copies:", enough["corrupted"])
    if depth > 1:
        short = steploop.simulate("ring", steps=8, ahead=2, ring_depth=depth - 1)
        print(f"a ring of {depth - 1}: corrupted copies:", short["corrupted"])
except NotImplementedError:
    print("write min_ring_depth above first")
