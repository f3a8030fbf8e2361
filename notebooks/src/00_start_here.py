# %% [markdown]
# # 00 · Start here
#
# **Honest host-to-device copies in PyTorch**: an executable course. Every number it shows is
# measured in the notebook that shows it: on your GPU if this machine has one, otherwise replayed
# from the course's recorded GPU run and labelled so. What it says about how torch, CUDA, vLLM and
# FlashInfer work is read from their source, listed with source and version in `docs/facts.md`; what
# it says about platforms it never ran on (a GH200, ROCm, WSL2) is marked "not measured here", with
# its source.
#
# It is reconstructed from a real vLLM performance fix (vLLM 0.29, *"avoid H2D copies from
# non-pinned CPU tensors"*) and the history of races and stalls around it.
#
# **What you will learn in this notebook**
# - what the course covers, and for whom;
# - how to run it, with or without a GPU;
# - what *this* machine can show: the doctor and the platform report.

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

# %% [markdown]
# ## Who it is for
# Engineers who move tensors between CPU and GPU and want to know what really happens: inference
# engineers being onboarded, self-learners, workshop groups. You need PyTorch basics, not CUDA C++.
#
# ## The syllabus

# %%
from IPython.display import Markdown, display

from pinlab import syllabus

display(Markdown(syllabus.markdown()))

# %% [markdown]
# Without a GPU every lesson still runs top to bottom: GPU experiments show the latest recorded GPU
# run's results and say so (`recorded on <GPU>, <date>`); loops that only need the *order* of host
# and GPU work run on an emulated stream, labelled "emulated".

# %% [markdown]
# ## How to run it
#
# ```bash
# make lab     # JupyterLab on the course (sets up .venv on first use)
# make run     # run every notebook headless, HTML under build/html/index.html
# make test    # unit tests and every notebook under nbval
# ```
#
# `[timing]` and `[measured]` lines hold measured numbers: on a GPU, this machine's, now; without
# one, the recorded GPU run's (each experiment's `[measured] source: ...` line says which, with the
# GPU and the date). They change from run to run, and the notebook tests ignore them, as they ignore
# the cells printing tables and listings from a measurement (the doctor's report, the lessons'
# tables). Every other output is a checked fact, true on every run, live or replayed.

# %% [markdown]
# ### Where your work lives
#
# `make lab` opens your own copy of the course: the first time, it copies the lessons, exercises and
# solutions into `work/` (git-ignored); this notebook is one of those copies. Change and save
# anything: the course's own notebooks (holding the recorded GPU run) stay as they are. To start a
# notebook over, delete it from `work/` and rerun `make lab`: it copies only what is missing. On
# Colab the notebook is Colab's copy (File > Save a copy in Drive keeps your changes).

# %% [markdown]
# ## The doctor
# It checks the packages, prints this machine's platform (the GPU, its link, who else uses it, the
# CPU cores, WSL2...) and says which experiments run live here and which replay the recorded GPU
# run, and why (one needing more free VRAM or pinned memory than this machine has, or a profiler
# that records GPU activity, replays instead of failing mid-lesson).

# %% tags=["nbval-ignore-output"]
import pinlab

pinlab.header("00 start here")
report = pinlab.doctor()

# %% [markdown]
# The cell above depends on your machine, so its output is not checked. The next one is:
# everything the course *needs* must be there, GPU or not.

# %%
pinlab.claim(
    "everything the course needs is installed",
    report["ok"],
    why="a package is missing or a recorded GPU run is broken "
    "(the FAIL lines above say which): run `make setup` (or "
    "`git checkout -- reports/gpu`), then re-run this notebook",
)

# %% [markdown]
# ## The platform: what this machine is
#
# The doctor's facts, as an experiment: on a GPU, this machine's, measured now; without one, the
# recorded run's machine, replayed (the `source` line says which). They decide how far the lessons'
# numbers carry over to your machine:
# - the **copy engines** are the GPU's DMA units: they move data over the link beside the cores that
#   run kernels, so a copy can run while a kernel does (lesson 02b);
# - the **link** (PCIe generation and width, or NVLink-C2C on a GH200) sets the copy bandwidth
#   lesson 01 measures; on a GH200 the GPU also reads pageable memory through the host's page
#   tables, so pageable copies come much closer to pinned ones (the course never ran on one: not
#   measured here, `docs/facts.md` F15);
# - **other processes on the GPU** (say, other learners) interleave their kernels with yours:
#   timings vary more, and a race can show more or less often;
# - the **CPU cores** and **WSL2** change how fast and evenly the host runs (under WSL2 the profiler
#   often records no GPU activity, so the timelines of lessons 02b, 06 and 07 replay; WSL2 was not
#   measured here: `docs/facts.md` F18).
#
# The lessons *assert* only what should hold on any CUDA GPU, quiet or shared (exact results,
# counts, 0 corrupted steps). That held on every GPU the course has run on (so far an NVIDIA H200
# and NVIDIA H100s, quiet and under the adverse conditions it imitates: `reports/gpu/`), and each
# assert's message names what would break it. What depends on these facts is printed as a `[measured]` line
# saying whether it held in this run.

# %%
from pinlab.doctor import platform_lines

plat = pinlab.measure("00_platform", pinlab.platform_facts)
for label, text in platform_lines(plat.result):
    pinlab.show(label, text)

# %% [markdown]
# ## Your first measurement
#
# 🔮 **Predict.** You copy 4 bytes from the CPU to the GPU and time it with two CUDA events, recorded
# just before and just after the copy. Roughly how long is it between them: 1 ns, 1 µs or 10 µs?
#
# <details><summary>Answer</summary>
#
# 10 µs or more: tens of microseconds is common (see the `[timing]` line below), whatever the bytes.
# On an idle GPU the first event is passed at once; the GPU then waits for the host to launch the
# copy, moves 4 bytes over PCIe, and reaches the second event: a host round trip for one tiny copy,
# not the GPU's work. Lesson 01 separates the two: it times copies queued back to back behind a busy
# GPU to find what the copy engine itself needs per copy.
# </details>

# %%
import torch


def tiny_copy_ms():
    """Event-to-event ms around one 4-byte H2D copy on
    an idle GPU: the host's launch plus the copy."""
    src = torch.ones(1, dtype=torch.int32)
    dst = torch.empty(1, dtype=torch.int32, device="cuda")
    return pinlab.cuda_time(lambda: dst.copy_(src), repeat=20).as_dict()


tiny = pinlab.measure("00_tiny_copy", tiny_copy_ms)
pinlab.report(
    "one 4-byte H2D copy, events around it (launch + copy)", tiny.result["median"]
)

# %%
pinlab.observe(
    "one 4-byte copy, timed alone, takes at least a microsecond",
    tiny.result["median"] >= 1e-3,
    value=pinlab.fmt_ms(tiny.result["median"]),
    why="the events bracket the host's launch only when the GPU passes the "
    "first one before the copy is submitted: a GPU busy with other processes' "
    "work passes it late, and then the events bracket the copy alone",
)
us, others = tiny.result["median"] * 1e3, plat.result.get("other_gpu_processes")
if us <= 100:
    said = (
        "the host's launch and a tiny copy over the link: a round trip, not the bytes"
    )
elif others:
    said = (
        f"far above tens of µs: {others} other process(es) shared this "
        "GPU, which (without MPS) takes turns between processes' work, "
        "so the span between the two events can include their turns"
    )
else:
    said = (
        "far above tens of µs with no other process seen on the GPU: a slow or busy "
        "host, or a GPU still waking from idle, stretched the span between the events"
    )
pinlab.show("what this run shows", f"{pinlab.fmt_ms(tiny.result['median'])}: {said}")

# %% [markdown]
# ## What to remember
# - Numbers are measured: live on a GPU, else a labelled replay of the recorded GPU run. Facts about
#   torch, CUDA, vLLM and FlashInfer cite their source (`docs/facts.md`); platforms the course never
#   ran on are marked "not measured here".
# - `[timing]` and `[measured]` lines, and tables and listings printed from a measurement, are
#   measured numbers; everything else is a checked fact: it held on every GPU the course ran on,
#   and its message names what would break it.
# - How far a number carries over depends on the platform (the link, a shared GPU, the CPU cores,
#   WSL2): the doctor and the platform report say what yours is.
# - A small copy timed alone measures a round trip through the host, not the copy.
# - Next: **01 · Pinned memory**.
