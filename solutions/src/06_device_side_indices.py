# %% [markdown]
# # Exercises · 06 Build indices on the device
#
# Two pieces of torch code from the lesson, checked on any machine: on a CPU the checkers run your
# code on the **emulated lagging stream** (`pinlab.LaggingStream`), where device work waits in a
# queue until the host waits for it, `pin_memory()` works, and a tensor made with `device=device`
# counts as GPU memory. So what would race or stall on a GPU shows up here too.

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

from pinlab.checks import l06 as checks06
from pinlab.lessons import l06_device_side_indices as l06

# %% [markdown]
# ## 1. Rotary position ids for a whole batch, without a Python loop over images
#
# Qwen2-VL gives every vision token a (row, column) position. For an image or video of `t`
# frames of `h × w` patches and merge size `m`, the tokens of one frame go **block by block**
# (the `m × m` merge blocks, row-major), row-major inside a block, and every frame repeats the
# same positions. For token `k` of a frame:
#
# `b = k // m²`, `r = k % m²`, `row = (b // (w/m))·m + r // m`, `col = (b % (w/m))·m + r % m`.
#
# Write `rot_pos_ids(grid_thw, m, device)`: `grid_thw` is a list of `[t, h, w]` rows (h and w
# multiples of m); return an int64 tensor `[Σ t·h·w, 2]` of (row, col) **on `device`**, equal to the
# lesson's (a) `l06.ids_before`, and:
# - **no Python loop of per-image launches**: the number of torch calls must not grow with the
#   number of images (a loop over the rows doing *host* arithmetic on Python ints is fine);
# - **at most one small H2D copy**, from pinned memory, `non_blocking=True` (`.pin_memory()`
#   then `.to(device, non_blocking=True)`: this works on the emulated stream and on CUDA);
# - **no host sync**: the host knows `N = Σ t·h·w` already, so pass it where torch would
#   otherwise read it from the device (`output_size=`).
#
# *(10-14 lines)*


# %%
def rot_pos_ids(grid_thw, m, device):
    ### BEGIN SOLUTION
    counts = [t * h * w for t, h, w in grid_thw]
    starts, acc = [], 0
    for c in counts:
        starts.append(acc)
        acc += c
    table = [[c, s, h * w, w // m] for c, s, (_, h, w) in zip(counts, starts, grid_thw)]
    table = (
        torch.tensor(table, dtype=torch.int64)
        .pin_memory()
        .to(device, non_blocking=True)
    )
    total = sum(counts)
    per_token = torch.repeat_interleave(
        table[:, 1:], table[:, 0], dim=0, output_size=total
    )
    start, frame, blocks_per_row = per_token.unbind(1)
    k = (torch.arange(total, device=device) - start) % frame
    b, r = k // (m * m), k % (m * m)
    return torch.stack(
        [(b // blocks_per_row) * m + r // m, (b % blocks_per_row) * m + r % m], dim=-1
    )
    ### END SOLUTION


checks06.check_rot_pos_ids(rot_pos_ids)

# %% [markdown]
# ## 2. Per-step results back to the host, read only after their event
#
# Each step of an engine computes a small result on the GPU (sampled token ids, logprobs) that
# the host needs *later*. vLLM copies it into **pinned** host memory with `non_blocking=True`,
# records an event, and reads it only after that event (its logprobs tensors are created pinned
# for this). The host stays one step ahead: it reads step n-1's result while step n is in flight.
#
# Write the two halves:
# - `start_d2h(s, out)`: `out` is step n's result on the device of stream `s`. Queue its copy into a
#   **fresh pinned** host tensor (`non_blocking=True`), record an event `s.Event()` after it, and
#   return `(host, event)` at once: do not wait for the GPU;
# - `finish_d2h(host, event)`: return the values (`host.tolist()`), read only after the copy has run,
#   and wait for nothing more than this step's event.
#
# *(5-7 lines)*


# %%
def start_d2h(s, out):
    ### BEGIN SOLUTION
    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
    host.copy_(out, non_blocking=True)
    ev = s.Event()
    ev.record()
    return host, ev
    ### END SOLUTION


def finish_d2h(host, event):
    ### BEGIN SOLUTION
    event.synchronize()
    return host.tolist()
    ### END SOLUTION


checks06.check_d2h_outputs(start_d2h, finish_d2h)

# %% [markdown]
# ## What to remember
# - An index that depends only on shapes can be built **on the device**: no host tensor, no copy.
# - Build it for **all images at once**: per-image `arange` chains cost one launch chain per image,
#   which can be slower than the CPU build for many small images.
# - When a small table must go to the device, copy it **once**, pinned and `non_blocking`; tell
#   torch the sizes the host knows (`output_size=`) so that nothing reads the device back.
# - A D2H result lands in **pinned** memory with `non_blocking=True` and is valid only after its
#   **event**: read it then, and wait for that event only.
