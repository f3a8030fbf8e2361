# %% [markdown]
# # Exercises · 05 Restoring offloaded weights straight into pinned memory
#
# Two exercises: the torch code of the restore itself, and the pinned memory it costs. Write each
# where it says `YOUR CODE HERE`, then run the check cell below it. No GPU needed: without one, the
# first check runs your code on the emulated lagging stream (`pinlab.LaggingStream`), which knows
# what is pinned, what is "on the GPU" and what is still queued.

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

from pinlab.checks import l05 as checks05

# %% [markdown]
# ## 1. Restore a weight with one copy, straight into pinned memory
#
# `restore_weight(w, pin=True)` gets a weight `w` that lives on the GPU and returns its copy in host
# memory, ready to use when the function returns:
# - **one copy**, with no pageable intermediate (`w.to("cpu").pin_memory()` copies twice);
# - **pinned** memory when `pin=True`, so that the next `non_blocking` reload does not block the host;
#   **pageable** memory when `pin=False` (the switch, like `VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1`);
# - the same shape, dtype and values, bit for bit, and not the GPU tensor itself.
#
# The checker keeps the GPU busy while your function runs, counts the copies it makes, and tells you
# what went wrong in the lesson's terms. *(1 line)*


# %%
def restore_weight(w, pin=True):
    ### BEGIN SOLUTION
    return torch.empty_like(w, device="cpu", pin_memory=pin).copy_(w)
    ### END SOLUTION


checks05.check_restore_weight(restore_weight)

# %% [markdown]
# ## 2. How much pinned memory does it cost?
#
# PyTorch's caching host allocator rounds every pinned request up to the next power of two (lesson
# 01), and the restore above makes one pinned tensor per weight.
#
# `pinned_footprint(param_bytes)` returns the total bytes page-locked when each weight of
# `param_bytes` (a list of byte counts) gets its own pinned tensor. A weight of 0 bytes pins
# nothing. The check then applies your function to the model of the recorded GPU run, when there
# is one, and compares with what the allocator really took. *(2-4 lines)*


# %%
def pinned_footprint(param_bytes):
    ### BEGIN SOLUTION
    return sum(1 << (n - 1).bit_length() for n in param_bytes if n > 0)
    ### END SOLUTION


checks05.check_pinned_footprint(pinned_footprint)

# %% [markdown]
# ## What to remember
# - `torch.empty_like(w, device="cpu", pin_memory=pin).copy_(w)`: allocate the destination where it must
#   end up, then copy once. `.to("cpu")` gives pageable memory; `.to("cpu").pin_memory()` copies twice.
# - A restore is done when it returns: no `non_blocking=True` on a device-to-host copy you read at once.
# - Pinned memory is rounded up to a power of two per block: a Llama-7B MLP weight of 86 MiB locks
#   128 MiB. Budget host RAM for the rounded footprint, not for the model's size.
