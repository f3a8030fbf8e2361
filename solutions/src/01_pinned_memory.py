# %% [markdown]
# # Exercises · 01 Pinned memory
#
# Two small functions that turn a bandwidth sweep into numbers you can reason with. Write each
# one where it says `YOUR CODE HERE`, then run the check cell below it.

# %%
import pinlab
from pinlab.checks import l01 as checks

# %% [markdown]
# ## 1. Bandwidth from a timing
#
# `gbps(nbytes, ms)` returns the rate in **GB/s**: 10⁹ bytes per second (not GiB/s), for
# `nbytes` moved in `ms` milliseconds. *(1 line)*

# %%
def gbps(nbytes, ms):
    ### BEGIN SOLUTION
    return nbytes / (ms * 1e-3) / 1e9
    ### END SOLUTION


ok = checks.check_gbps(gbps)

# %% [markdown]
# ## 2. Where latency stops dominating: N½
#
# `n_half(sizes, rates)` returns the **smallest size** whose rate is at least half the peak
# rate (the peak is the largest rate in `rates`). Sizes may come in any order, and rates need
# not grow with size. Below N½ a copy is mostly latency; above it, mostly bandwidth. *(2-3 lines)*

# %%
def n_half(sizes, rates):
    ### BEGIN SOLUTION
    peak = max(rates)
    return min(s for s, r in zip(sizes, rates) if r >= peak / 2)
    ### END SOLUTION


ok = checks.check_n_half(n_half)
