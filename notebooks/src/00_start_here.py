# %% [markdown]
# # 00 · Start here
#
# **Honest host-to-device copies in PyTorch**: an executable course. Every claim is backed by a
# measurement in the notebook that makes it: made now, on your GPU, if this machine has one;
# otherwise replayed from the course's recorded GPU run, and labelled as such.
#
# It is reconstructed from a real vLLM performance fix (vLLM 0.29, *"avoid H2D copies from
# non-pinned CPU tensors"*) and the history of races and stalls around it.
#
# **What you will learn in this notebook**
# - what the course covers, and for whom;
# - how to run it, with or without a GPU;
# - what *this* machine can show (the doctor below).

# %% [markdown]
# ## Who it is for
# Engineers who move tensors between CPU and GPU and want to know what really happens:
# inference engineers being onboarded, people teaching themselves, workshop groups.
# You need to know PyTorch basics; you do not need CUDA C++.
#
# ## The syllabus
#
# | lesson | topic | minutes | needs a GPU to measure live |
# |---|---|---|---|
# | 00 | start here: set-up, the doctor | 10 | no |
# | 01 | pinned memory: bandwidth, latency, the cost of pinning | 30 | yes (replayed without) |
# | 02 | fake `non_blocking`: when a copy really is asynchronous | 40 | yes (replayed without) |
# | 03 | the race: a reused pinned buffer and a CPU that runs ahead | 40 | yes (replayed without) |
# | 04 | the fix: pin snapshots, and the history of fixes | 40 | yes (replayed without) |
# | 05 | restoring offloaded weights straight into pinned memory; sleep/wake; zero-copy | 40 | yes (replayed without) |
# | 06 | build indices on the device: rotary ids without an H2D copy, launches against copies | 40 | yes (replayed without) |
#
# Without a GPU every lesson still runs top to bottom: GPU experiments show the results the
# latest GPU run recorded, and say so (`recorded on <GPU>, <date>`), and the loops that only
# need the *order* of host and GPU work run on an emulated stream, labelled "emulated".

# %% [markdown]
# ## How to run it
#
# ```bash
# make lab     # JupyterLab on the course (sets up .venv on first use)
# make run     # run every notebook headless, HTML under build/html/index.html
# make test    # unit tests and every notebook under nbval
# ```
#
# Lines that start with `[timing]` or `[measured]` hold measured numbers: on a GPU, numbers
# measured now on this machine; without one, the numbers of the recorded GPU run (the
# `[measured] source: ...` line of each experiment says which, with the GPU and the date). They
# change from run to run, and the notebook tests ignore them. Every other output is a checked
# fact, true on every run, live or replayed.

# %% [markdown]
# ## The doctor
# It checks the packages and tells you what this machine can show.

# %% tags=["nbval-ignore-output"]
import pinlab

pinlab.header("00 start here")
report = pinlab.doctor()

# %% [markdown]
# The cell above depends on your machine, so its output is not checked. The next one is:
# everything the course *needs* must be there, GPU or not.

# %%
print("everything the course needs is installed:", report["ok"])
assert report["ok"], "run `make setup`, then re-run this notebook"

# %% [markdown]
# ## Your first measurement
#
# 🔮 **Predict.** You copy 4 bytes from the CPU to the GPU and time it with two CUDA events, one
# recorded just before the copy and one just after. Roughly how long is it between them:
# 1 ns, 1 µs or 10 µs?
#
# <details><summary>Answer</summary>
#
# Microseconds, and the bytes have almost nothing to do with it. On an idle GPU the first event
# is passed at once; then the GPU waits for the host to launch the copy, moves 4 bytes over
# PCIe, and reaches the second event. So this measures a host round trip for one tiny copy, not
# the GPU's work. Lesson 01 separates the two: it times copies queued back to back behind a busy
# GPU to find what the copy engine itself needs per copy.
# </details>

# %%
import torch


def tiny_copy_ms():
    """Event-to-event ms around one 4-byte H2D copy on an idle GPU: the host's launch plus the copy."""
    src = torch.ones(1, dtype=torch.int32)
    dst = torch.empty(1, dtype=torch.int32, device="cuda")
    return pinlab.cuda_time(lambda: dst.copy_(src), repeat=20).as_dict()


tiny = pinlab.measure("00_tiny_copy", tiny_copy_ms)
pinlab.report("one 4-byte H2D copy, events around it (launch + copy)", tiny.result["median"])

# %%
print("one 4-byte copy, timed alone, takes at least a microsecond:", tiny.result["median"] >= 1e-3)
assert tiny.result["median"] >= 1e-3

# %% [markdown]
# ## What to remember
# - Every lesson measures its claims; without a GPU it replays the recorded GPU run and says so.
# - `[timing]` and `[measured]` lines are measured numbers (this GPU's now, or the recorded run's in
#   a replay); everything else is a checked fact.
# - A small copy timed alone measures a round trip through the host, not the copy.
# - Next: **01 · Pinned memory**.
