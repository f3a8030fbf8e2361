"""Exercise checkers for lesson 08 (CUDA graphs: what a captured copy reads).

Each checker prints one verdict line (⏳ not implemented, ❌ what is wrong, in the lesson's terms, ✅ correct),
adds a hint from the second failure on, and returns True or False. ``tests/test_checks_l08.py`` proves each
accepts the master solution and rejects planted wrong answers with the right message. Both run the learner's
torch code on the CUDA stream, or on the emulated :class:`pinlab.LaggingStream` (which captures and replays
graphs, and refuses in a capture what CUDA refuses).

* :func:`check_capturable_step`: ``step(ids, out)`` must capture into a graph (no pageable copy, no wait for
  the GPU) and, replayed, compute ``out`` from whatever ``ids`` holds at each replay;
* :func:`check_graph_stage`: ``stage(s, meta, static, state)`` must get each step's host metadata into the
  graph's static input so that every replay reads its own step's data, with no pageable copy and no wait for
  the GPU, while the host rewrites the metadata right after each call.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from ..streams import CAPTURE_PAGEABLE_ERROR, stream
from ..timing import show
from . import LearnerStop, is_stub, learner_arg, learner_call, not_implemented, raised
from .l02 import _h2d_of

_failures: Counter = Counter()

HINTS = {
    "capturable_step": "build the positions on the GPU (`torch.arange(n, device=ids.device)`) instead of copying "
                       "them from the host, and replace the `.item()` test by a device-side op (`torch.clamp`): a "
                       "capture records work, so nothing in it may need a value back on the host.",
    "stage": "give every step its own pinned memory: `static.copy_(meta.pin_memory(), non_blocking=True)` copies "
             "a fresh pinned snapshot, which nobody rewrites before the copy has run.",
}

#: The lesson's step: ``out = min(ids * 2 + position, LIMIT)``.
LIMIT = 1000


def reset() -> None:
    """Forget earlier failures (the hint shows from a checker's second failure on)."""
    _failures.clear()


def _fail(name: str, message: str) -> bool:
    _failures[name] += 1
    print(f"❌ {message}")
    if _failures[name] >= 2:
        print(f"💡 Hint: {HINTS[name]}")
    return False


def reference_step(ids: torch.Tensor) -> torch.Tensor:
    """What the step computes from ``ids`` (int64): ``min(ids * 2 + position, LIMIT)``."""
    pos = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    return torch.clamp(ids * 2 + pos, max=LIMIT)


class _CopySpy(TorchFunctionMode):
    """Counts host-to-device copies from pageable memory (``copy_``, ``.to(device)``, ``.cuda()``: lesson 02's
    ``_h2d_of``) and device-to-host ``copy_`` into pageable memory, on either stream. (While a mode's
    ``__torch_function__`` runs, torch takes the mode off the stack: its own calls are not seen.)"""

    def __init__(self, s):
        super().__init__()
        self.s, self.pageable = s, 0

    def _device(self, t) -> bool:
        return self.s.is_device(t) if self.s.emulated else t.device.type == "cuda"

    def _device_target(self, target) -> bool:
        if isinstance(target, int):
            return True  # a CUDA device index
        return self.s._is_our_device(target) if self.s.emulated else torch.device(target).type == "cuda"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        h2d = _h2d_of(name, args, kwargs, self._device, self._device_target)
        if h2d is not None:
            self.pageable += not h2d[0].is_pinned()
        elif name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if self._device(src) and not self._device(dst) and not dst.is_pinned():
                self.pageable += 1
        return func(*args, **kwargs)


# ---- 1. a step that can be captured ---------------------------------------------------------------------

STEP_CASES = [[3, 1, 4, 1, 5, 9, 2, 6], [0] * 8, [400, 500, 600, 700, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7, 7, 7]]


def check_capturable_step(fn) -> bool:
    """``step(ids, out)``: writes ``min(ids * 2 + position, LIMIT)`` into ``out`` using only device work, so that
    it can be captured in a CUDA graph and replayed for new ``ids``."""
    name = "capturable_step"
    learner_arg(name, fn, "(ids, out) -> None (writes into out)")
    with stream() as s:
        show("capturable_step checked on", s.label)
        ids = torch.zeros(8, dtype=torch.int64, device=s.device)
        out = torch.zeros(8, dtype=torch.int64, device=s.device)
        g = torch.cuda.CUDAGraph()
        try:
            with learner_call("step(ids, out) inside torch.cuda.graph(g)"), torch.cuda.graph(g):
                fn(ids, out)
        except LearnerStop as stop:
            return _fail(name, f"{name}: {stop}")
        except Exception as exc:  # noqa: BLE001 - the learner's step, reported
            if is_stub(exc, fn):
                return not_implemented(name)
            text = str(exc)
            if "unless the CPU tensor is pinned" in text or CAPTURE_PAGEABLE_ERROR in text:
                return _fail(name, f"{name} cannot be captured: it copies between pageable host memory and the GPU "
                                   f"(torch: \"{CAPTURE_PAGEABLE_ERROR}\"). Build the tensor on the GPU, or copy it "
                                   "from pinned memory outside the graph.")
            if "capturing" in text or "during capture" in text:  # CUDA's, or the error ending the capture
                return _fail(name, f"{name} cannot be captured: it makes the host wait for the GPU (a `.item()`, "
                                   "`.tolist()`, `print` of a device value or a blocking copy). A capture records "
                                   "work without running it: compute the decision on the device instead.")
            return _fail(name, f"capturing {name}(ids, out) raised {raised(exc)}")
        for case in STEP_CASES:
            ids.copy_(torch.tensor(case, dtype=torch.int64))   # outside the graph: the step's new input
            g.replay()
            s.synchronize()
            got, want = out.tolist(), reference_step(torch.tensor(case, dtype=torch.int64)).tolist()
            if got != want:
                if got == reference_step(torch.zeros(8, dtype=torch.int64)).tolist() and any(case):
                    return _fail(name, f"replayed with ids={case}, out was {got}: the answer computed at capture "
                                       "time. A graph replays its kernels, not the Python around them: compute "
                                       "out from ids with torch ops on the device, inside the step.")
                return _fail(name, f"replayed with ids={case}, out was {got}, expected {want} "
                                   f"(min(ids * 2 + position, {LIMIT})).")
    _failures.pop(name, None)
    print(f"✅ {name} is correct: captured, and {len(STEP_CASES)} replays computed from new ids.")
    return True


# ---- 2. staging a captured step's inputs ------------------------------------------------------------------

def staging_run(stage, s, *, steps: int = 60, busy_ms: float = 50.0) -> dict:
    """The regression test's loop (lesson 08) with the learner's ``stage``: per step what the replay read, the
    pageable copies made, and whether the host waited for the GPU (the busy work done before the loop ended)."""
    meta = torch.zeros(16, dtype=torch.int32)
    static = torch.zeros(16, dtype=torch.int32, device=s.device)
    out = torch.zeros(16, dtype=torch.int32, device=s.device)
    seen = torch.zeros(steps, dtype=torch.int32, device=s.device)
    state: dict = {}
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(static)                     # the step's kernels read the static input
    s.busy(busy_ms)                           # the GPU far behind the host
    behind = s.Event()
    behind.record()
    spy = _CopySpy(s)
    with spy:
        for n in range(steps):
            meta.fill_(n)
            with learner_call(f"stage(s, meta, static, state) at step {n}"):
                stage(s, meta, static, state)
            g.replay()
            seen[n:n + 1].copy_(out[:1])
            meta.fill_(-1)                    # the host rewrites the metadata at once
    waited = behind.query()
    s.synchronize()
    return {"seen": seen.tolist(), "pageable": spy.pageable, "waited": bool(waited)}


def check_graph_stage(fn) -> bool:
    """``stage(s, meta, static, state)``: gets ``meta``'s current contents into the graph's static input for the
    replay that follows, while the host rewrites ``meta`` right after; no pageable copy, no wait for the GPU."""
    name = "stage"
    learner_arg(name, fn, "(s, meta, static, state) -> None")
    with stream() as s:
        show("stage checked on", s.label)
        try:
            run = staging_run(fn, s)
        except LearnerStop as stop:
            return _fail(name, f"{name}: {stop}")
        except Exception as exc:  # noqa: BLE001
            if is_stub(exc, fn):
                return not_implemented(name)
            return _fail(name, f"{name}(s, meta, static, state) raised {raised(exc)}")
    seen = run["seen"]
    wrong = [n for n, v in enumerate(seen) if v != n]
    if wrong:
        n = wrong[0]
        v = seen[n]
        if v > n or v == -1:
            why = (f"step {n}'s replay read {'the rewritten metadata (-1)' if v == -1 else f'step {v}'}'s data: the "
                   "copy read memory the host rewrote before the copy ran. A buffer reused every step (pinned, "
                   "captured or not) races when the GPU is behind; give every step its own pinned snapshot.")
        else:
            why = (f"step {n}'s replay read {v}: the static input did not receive this step's metadata before the "
                   "replay. Copy into `static` (the graph's own input), in place, before the replay.")
        return _fail(name, f"{name}: {len(wrong)} of {len(seen)} steps read another step's data; {why}")
    if run["waited"]:
        return _fail(name, f"{name} is correct but waits for the GPU: the busy work queued before the loop had run "
                           "when it ended. A sync, a blocking copy or an event wait (a ring of buffers wraps around "
                           "while the GPU is behind) ties the host to the GPU; a pinned snapshot needs no wait.")
    if run["pageable"]:
        return _fail(name, f"{name} is correct here but makes {run['pageable']} copies from pageable memory: the "
                           "driver stages small ones at the call, but a large one waits for the GPU, and a graph "
                           "cannot capture them. Copy a pinned snapshot (`meta.pin_memory()`).")
    _failures.pop(name, None)
    print(f"✅ {name} is correct: {len(seen)} steps each read their own metadata, the host never waited, no pageable "
          "copy.")
    return True
