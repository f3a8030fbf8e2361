# %% [markdown]
# # Exercise · 07 Capstone: fix the inference loop
#
# **What you will practise**: everything at once. The loop below is notebook 07's planted loop: a
# toy decoder over a paged KV cache, an offloaded LM head restored every step, a vision encoder,
# per-step metadata copies, per-step tokens copied back. Fix its five problems in `fixed_loop`. No
# GPU needed: without one, the checker uses the emulated lagging stream (`pinlab.LaggingStream`),
# exact about the order of host writes, copies and reads.
#
# The engine `m` (notebook 07, "The engine") gives you: `m.stream` (`s.Event()`, `s.synchronize()`),
# `m.lm_head` (the LM head's GPU buffer), `m.meta_ints`, `m.max_batch`, `m.eos`, `m.meta_dev[n]`
# (where step n's metadata must land), `m.schedule(n, buf)`, `m.encode(n)`, `m.decode(n)` (returns
# step n's tokens on the GPU), `m.emit(k, host_tokens)` (reads them *now*; returns the list it
# read), `m.note_stop(k)`, `m.host_work()`.

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

from pinlab.checks import l07 as checks07

# %% [markdown]
# ## The loop as written
#
# The checker (`checks07.check_fixed_loop(planted_loop, steps=50)`) names its problems one at a
# time.


# %%
def planted_loop(m, steps):
    """The capstone's inference loop as written:
    it runs, and it is wrong in five places."""
    s = m.stream
    m.lm_head_host = m.lm_head.to("cpu")  # offload the LM head to host memory
    # the metadata buffer
    meta = torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True)
    tokens_host = torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
    m.schedule(0, meta)  # the scheduler writes step 0's metadata
    for n in range(steps):
        # restore the offloaded LM head (8 MiB)
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)
        m.encode(n)  # vision encoder: rotary ids, GPU work
        snap = meta.pin_memory()  # a private snapshot of step n's metadata
        m.meta_dev[n].copy_(snap, non_blocking=True)  # H2D: indptr + last_page_len
        if n + 1 < steps:
            m.schedule(n + 1, meta)  # the scheduler moves on to step n+1
        tokens = m.decode(n)  # paged attention, LM head, argmax (GPU)
        tokens_host.copy_(tokens, non_blocking=True)  # D2H into pinned memory
        m.emit(n, tokens_host)  # hand step n's tokens to the detokenizer
        if tokens.eq(m.eos).any().item():  # did a request finish?
            m.note_stop(n)
        m.host_work()  # the server, the detokenizer (CPU)
    s.synchronize()


# %% [markdown]
# ## Fix it
#
# Write `fixed_loop(m, steps)`: the same work (restore the LM head, encode, copy step n's metadata
# into `m.meta_dev[n]`, decode, bring the tokens back, emit every step's tokens once, note every
# step whose tokens hold `m.eos`, do the host work), and:
# - **no pageable `non_blocking` copy** (where should the offloaded LM head live? lesson 05);
# - **no race**: no buffer rewritten before the copy that reads it has run, and no `pin_memory()` of
#   a pinned buffer passed off as a snapshot (lessons 03 and 04);
# - **no host sync inside the loop**: no `.item()`, `.tolist()`, `bool()` of a GPU tensor, no
#   `s.synchronize()` every step (lesson 02), and no wait on the event of the step you just enqueued
#   (a full wait too); a wait on an event at least one step older, bounding the run-ahead, is fine,
#   and so is one `s.synchronize()` at the end;
# - **no early or late read**: read a `non_blocking` D2H result only after an event recorded behind
#   it, and before a later step's copy reuses its buffer;
# - **the same engine**: the LM head stays offloaded, restored into `m.lm_head` before every step.
#
# Start from a copy of `planted_loop`'s body. The checker runs it for 1000 steps and names what is
# still wrong. *(25-35 lines)*


# %%
def fixed_loop(m, steps, depth=4):
    ### BEGIN SOLUTION
    s = m.stream
    m.lm_head_host = torch.empty_like(m.lm_head, device="cpu", pin_memory=True).copy_(
        m.lm_head
    )
    meta = [
        torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True)
        for _ in range(depth)
    ]
    tokens_host = [
        torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
        for _ in range(depth)
    ]
    done = [None] * depth  # done[i]: recorded after the last step of slot i

    def deliver(k):  # step k's tokens, once its copies have run
        done[k % depth].synchronize()
        if m.eos in m.emit(k, tokens_host[k % depth]):
            m.note_stop(k)

    m.schedule(0, meta[0])
    for n in range(steps):
        i = n % depth
        # pinned source: a truly async copy
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)
        m.encode(n)
        # slot i is rewritten only after its event
        m.meta_dev[n].copy_(meta[i], non_blocking=True)
        tokens = m.decode(n)
        tokens_host[i].copy_(tokens, non_blocking=True)
        done[i] = s.Event()
        done[i].record()
        if n + 1 >= depth:
            deliver(n + 1 - depth)  # frees slot (n + 1) % depth
        if n + 1 < steps:
            m.schedule(n + 1, meta[(n + 1) % depth])
        m.host_work()
    for k in range(max(0, steps - depth + 1), steps):
        deliver(k)
    s.synchronize()
    ### END SOLUTION


checks07.check_fixed_loop(fixed_loop)

# %% [markdown]
# ## What to remember
# - Audit a loop copy by copy: where does the source live (pinned, or a `non_blocking` that may
#   wait), who rewrites it and when (before the copy has run, it races), when is a D2H result read
#   (after its event).
# - `pin_memory()` of a pinned buffer returns that same buffer: a snapshot must be a new tensor, or
#   give each step in flight its own slot of a ring guarded by events.
# - A hidden sync serialises host and GPU, and protects nothing if it comes after the write that
#   races.
# - A fast loop keeps only the waits on events that bound how far the host runs ahead.
# - The checker audits your loop's own lines, but libraries copy too: FlashInfer's `plan()` copies
#   its host metadata with `non_blocking=True`, so an engine hands it pinned tensors nobody rewrites
#   (notebook 07, the engine's fix).
