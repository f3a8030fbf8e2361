# %% [markdown]
# # Exercises · 01 Pinned memory
#
# Two small functions that turn a bandwidth sweep into numbers you can reason with. Write each
# one where it says `YOUR CODE HERE`, then run the check cell below it.

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


ok_gbps = checks.check_gbps.verdict(gbps)

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


ok_n_half = checks.check_n_half.verdict(n_half)


# %% [markdown]
# ## 3. Apply them to the recorded sweep
#
# Lesson 01's bandwidth sweep, as the course's GPU run recorded it
# (`reports/gpu/data/01_bandwidth.json`): your `gbps` turns each timing into a rate, your `n_half`
# finds where pinned H2D copies, each timed alone, reach half their best rate.

# %%
from pinlab.plots import fmt_bytes
from pinlab.replay import load_recorded

# validated: a broken file says which, and how to restore it
recorded = load_recorded("01_bandwidth")
if ok_gbps and ok_n_half:
    sizes = [r["bytes"] for r in recorded["result"]]
    rates = [gbps(r["bytes"], r["h2d_pinned_ms"]) for r in recorded["result"]]
    pinlab.show("recorded on", f"{recorded['meta']['gpu']}, {recorded['meta']['date']}")
    pinlab.show("best pinned H2D rate", f"{max(rates):.1f} GB/s")
    pinlab.show(
        "N½ of pinned H2D, one copy timed alone", fmt_bytes(n_half(sizes, rates))
    )
else:
    print("finish both functions above (both checks ✅), then re-run this cell")

# %% [markdown]
# ## What to remember
# - GB/s means 10⁹ bytes per second; milliseconds are 10⁻³ s.
# - N½ splits small copies (latency-bound: batch them) from large ones (bandwidth-bound).
# - Small copies timed alone each carry a host round trip (lesson 01's section on small copies), so
#   rates computed from them understate what copies issued back to back reach.
