# %% [markdown]
# # Exercises · 08 CUDA graphs: what a captured copy reads
#
# Two exercises: make a step capturable, then stage a captured step's inputs safely. Write each where it
# says `YOUR CODE HERE`, then run the check cell below it. No GPU needed: without one, the checks run your
# code on the emulated lagging stream, which captures and replays graphs and refuses in a capture what
# CUDA refuses.

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

from pinlab.checks import l08 as checks08

# %% [markdown]
# ## 1. Make a step capturable
#
# This step works eagerly, but a capture refuses it twice: it copies positions built on the host
# (pageable memory) to the GPU, and it asks the GPU for a value (`.item()`) to decide whether to clip:
#
# ```python
# def eager_step(ids, out):
#     pos = torch.arange(ids.numel()).to(ids.device)         # a pageable H2D copy
#     out.copy_(ids * 2 + pos)
#     if out.max().item() > checks08.LIMIT:                  # the host waits for the GPU
#         out.clamp_(max=checks08.LIMIT)
# ```
#
# Write `capturable_step(ids, out)`: the same result, `out = min(ids * 2 + position, LIMIT)`, with device
# work only, so that `torch.cuda.graph` can capture it and every replay computes `out` from whatever `ids`
# holds then. Write only into `out`: `ids` is the graph's input, and must be as it was after a replay.
# *(2-3 lines)*


# %%
def capturable_step(ids, out):
    ### BEGIN SOLUTION
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    torch.clamp(ids * 2 + pos, max=checks08.LIMIT, out=out)
    ### END SOLUTION


checks08.check_capturable_step(capturable_step)

# %% [markdown]
# ## 2. Stage a captured step's inputs safely
#
# The graph reads its input from a static device tensor `static`. Before each replay, `stage(s, meta,
# static, state)` must get the host metadata `meta` (pageable, rewritten by the host right after your
# function returns) into `static`, so that the replay reads this step's data:
# - every step reads all of its own data (16 values), with the GPU far behind the host;
# - no wait for the GPU (no `synchronize`, no event wait, no blocking copy): the host must stay ahead;
# - no copy from pageable memory.
#
# `state` is a dict you may keep buffers in between steps (a new one for every check); a stage that keeps
# pinned buffers (a ring) is run for more steps than it keeps buffers. *(1 line)*


# %%
def stage(s, meta, static, state):
    ### BEGIN SOLUTION
    static.copy_(meta.pin_memory(), non_blocking=True)
    ### END SOLUTION


checks08.check_graph_stage(stage)

# %% [markdown]
# ## What to remember
# - A capture records device work: no pageable copies, no `.item()`; build on the device, decide on the device.
# - A graph reads its inputs from static tensors at replay time: fill them outside the graph from memory
#   nobody rewrites before the copy has run, such as a fresh `pin_memory()` snapshot.
