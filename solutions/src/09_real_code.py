# %% [markdown]
# # Exercise · 09 Audit real code: fix a decode loop
#
# **What you will practise**: auditing a decode loop written the way users write one, and fixing it
# with lesson 09's deferred stop check. The loop decodes greedily with a sampling step (temperature,
# then argmax; finished sequences emit padding) and a custom stopping criterion (stop when every
# sequence has produced end-of-sequence, or when a step repeats every sequence's last token). Its
# tokens are right, but it waits for the GPU three times per token, and it reads its stop flag
# before the copy that writes it has run: a race.
#
# No GPU needed: without one, the checker runs your loop on the emulated lagging stream, exact about
# the order of host reads, copies and waits.
#
# The engine `m` gives you: `m.stream` (`s.Event()`, `s.synchronize()`, `s.device`),
# `m.forward(tokens)` (the `(batch,)` last tokens on the GPU -> `(batch, vocab)` logits on the GPU),
# `m.start` (each sequence's last prompt token, on the GPU), `m.batch`, `m.eos`, `m.pad`,
# `m.temperature`.

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

import pinlab
from pinlab.checks import l09 as checks09

# %% [markdown]
# ## The loop as written


# %%
class StopOnEosOrRepeat:
    """A custom stopping criterion, the way users
    write one (HF's StoppingCriteria style)."""

    def __init__(self, eos):
        self.eos = eos

    def __call__(self, prev, nxt, finished):
        if self.eos in nxt:  # did a sequence finish this step?
            finished = finished | (nxt == self.eos)
        stuck = torch.equal(nxt, prev)  # every sequence repeated its last token
        return finished, stuck


def planted_decode(m, max_new):
    """Greedy decoding with a custom stopping criterion, as written: right tokens, three
    host syncs per token, and a stop flag read before its copy has run."""
    s = m.stream
    stop = StopOnEosOrRepeat(m.eos)
    tokens = m.start.clone()
    finished = torch.zeros(m.batch, dtype=torch.bool, device=s.device)
    # the stop flag, read without a sync
    flag = torch.zeros((), dtype=torch.bool, pin_memory=True)
    out = []
    for n in range(max_new):
        logits = m.forward(tokens) / m.temperature  # the model, then the temperature
        # greedy; finished sequences pad
        nxt = torch.where(finished, m.pad, logits.argmax(dim=-1))
        if nxt.max().item() >= logits.shape[-1]:  # a sanity check
            raise ValueError("token out of range")
        out.append(nxt)
        finished, stuck = stop(tokens, nxt, finished)
        tokens = nxt
        flag.copy_(finished.all(), non_blocking=True)  # the flag, copied asynchronously
        if stuck or flag:
            break
    return torch.stack(out, dim=1)


# %% [markdown]
# ## Audit it
#
# 🔮 **Predict.** Which lines make the host wait for the GPU, and which line reads memory a copy has
# not finished writing? The checker names one problem at a time; the race detector names the race:

# %% tags=["nbval-ignore-output"]
checks09.check_decode(planted_decode)
with pinlab.stream() as s, pinlab.detect_races() as races:
    m = checks09.DecodeEngine(s, *checks09.CASES[0][1:3])
    planted_decode(m, checks09.CASES[0][3])
    s.synchronize()
print(races)

# %% [markdown]
# ## Fix it
#
# Write `fixed_decode(m, max_new)`: the same tokens, and
# - **no host sync inside the loop**: no `.item()`, `.tolist()`, `bool()` of a GPU tensor, no `x in
#   gpu_tensor` and no `torch.equal` of GPU tensors (each is a `.item()` inside);
# - **the stop decided on the GPU, read one step late**: one flag (all finished, or stuck) copied
#   with `non_blocking=True` into a pinned slot, an event recorded behind it; read a slot only after
#   its event, and not while a later copy writes it (lesson 09: two slots);
# - **no busy-wait** (`while not ev.query(): pass`) and no wait on the step you just queued: wait
#   for the *previous* step's event;
# - **stop at most one step late**: returning the one extra step is fine, and so is dropping it.
#
# Return the tokens as a `(batch, steps)` tensor (`torch.stack(out, dim=1)`). *(15-20 lines)*


# %%
def fixed_decode(m, max_new):
    ### BEGIN SOLUTION
    s = m.stream
    tokens = m.start.clone()
    finished = torch.zeros(m.batch, dtype=torch.bool, device=s.device)
    flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
    done = [None, None]
    out = []
    for n in range(max_new):
        logits = m.forward(tokens) / m.temperature
        nxt = torch.where(finished, m.pad, logits.argmax(dim=-1))
        out.append(nxt)
        finished = finished | (nxt == m.eos)
        stop = finished.all() | (nxt == tokens).all()  # the criterion, on the GPU
        tokens = nxt
        flags[n % 2].copy_(stop, non_blocking=True)  # this step's flag, asynchronously
        done[n % 2] = s.Event()
        done[n % 2].record()
        if n > 0:
            # step n - 1's copy has run; step n is queued
            done[(n - 1) % 2].synchronize()
            if flags[(n - 1) % 2]:  # step n - 1 met the criterion
                out.pop()  # step n was decoded after the stop
                break
    return torch.stack(out, dim=1)
    ### END SOLUTION


checks09.check_decode(fixed_decode)

# %% [markdown]
# ## What to remember
# - `x in gpu_tensor` and `torch.equal(a, b)` of GPU tensors are `.item()` in disguise: the host
#   waits for every kernel queued so far.
# - Decide on the GPU, read late: one flag per step into a ring of two pinned slots, an event behind
#   each copy, the previous step's slot read after its event (transformers' `DeferredStopCheck`).
# - One slot, or a read before the event, reads a copy still in flight: the race detector says
#   where.
