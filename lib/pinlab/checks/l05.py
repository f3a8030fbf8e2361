"""Exercise checkers for lesson 05 (restoring offloaded weights straight into pinned memory).

Each checker prints one verdict line (⏳ not implemented, ❌ what is wrong, in the lesson's terms,
✅ correct), adds a hint from the second failure on, and returns True or False.
``tests/test_checks_l05.py`` proves each accepts the master solution and rejects planted wrong
answers with the right message.

* :func:`check_restore_weight` runs the learner's torch code on the CUDA stream, or on the emulated
  :class:`pinlab.LaggingStream` without a GPU: one copy, straight into pinned memory, data there
  when it returns, nothing aliased, and pageable memory when the switch says so.
* :func:`check_pinned_footprint` checks the arithmetic on cases, then applies the learner's
  function to the recorded GPU run (``reports/gpu/data/05_restore.json``) when there is one.
"""
from __future__ import annotations

import json
import random
from collections import Counter

import torch

from ..lessons.l05_pinned_weight_restore import count_copies, pinned_footprint
from ..replay import data_dir
from ..streams import PIN_DEVICE_ERROR
from ..streams import stream
from ..timing import show
from . import (checker, say, LearnerStop, _fmt_args, _number, is_stub, learner_arg, learner_call, not_implemented, raised,
               same_int, same_tensor, summary)

_failures: Counter = Counter()

HINTS = {
    "restore_weight": "allocate the destination where it must end up, then copy once: "
                      "`torch.empty_like(w, device=\"cpu\", pin_memory=pin)` gives pinned (or, with pin=False, "
                      "pageable) host memory of w's shape, dtype and strides; `.copy_(w)` fills it and returns it.",
    "pinned_footprint": "round each request up on its own (`1 << (n - 1).bit_length()` for n > 0), then add; "
                        "a request of 0 bytes pins nothing.",
}


def reset() -> None:
    """Forget earlier failures (the hint shows from a checker's second failure on)."""
    _failures.clear()


def _fail(name: str, message: str) -> bool:
    _failures[name] += 1
    say(f"❌ {message}")
    if _failures[name] >= 2:
        say(f"💡 Hint: {HINTS[name]}")
    return False


# ---- 1. restore_weight: one copy, straight into pinned memory ----------------------------------

RESTORE_CASES = [((64, 96), torch.bfloat16, True), ((3, 50, 7), torch.float32, True),
                 ((1000,), torch.float16, True), ((48, 40), torch.bfloat16, False),
                 ((256, 130), torch.bfloat16, True)]
BUSY_MS = 20.0


def _problem(s, w, expected, out, ops, pin, pending) -> str | None:
    """What is wrong with ``out = restore_weight(w, pin)`` (None: nothing)."""
    call = f"restore_weight(<{tuple(w.shape)} {str(w.dtype).replace('torch.', '')} weight on the GPU>, pin={pin})"
    if not isinstance(out, torch.Tensor):
        return f"{call} returned {type(out).__name__}, not a tensor: return the host copy of the weight."
    if out.shape != w.shape or out.dtype != w.dtype:
        return (f"{call} returned shape {tuple(out.shape)} {out.dtype}, the weight is {tuple(w.shape)} {w.dtype}: "
                "a restore must not change the weight (no dtype conversion, no reshaping).")
    # on the emulated stream its GPU memory is what the stream holds as device memory (device="cpu"
    # is host memory there, as on a GPU: streams.py)
    on_gpu = s.is_device(out) if s.emulated else out.device.type != "cpu"
    if on_gpu:
        return (f"{call} returned a tensor that is still on the GPU: a restore makes a copy in host memory "
                "(device=\"cpu\"), so that the GPU memory can be freed.")
    if out.untyped_storage().data_ptr() == w.untyped_storage().data_ptr():
        return f"{call} returned the weight's own storage: a restore must be a copy, not an alias of the GPU tensor."
    if not ops and not pending and not same_tensor(out, expected):
        return (f"{call} made no copy of the data: the tensor it returned holds whatever its memory held "
                "(`empty_like` allocates, it does not copy). Copy the weight into it: `.copy_(w)`.")
    if pending or not same_tensor(out, expected):
        if pending or out.is_pinned():
            return (f"{call}: the data is not there yet when it returns. A `non_blocking=True` device-to-host copy "
                    "only enqueues the copy behind the busy GPU; the host would read garbage. Copy without "
                    "non_blocking (the restore must be done when it returns), or call `torch.cuda.synchronize()` "
                    "before returning (on the emulated stream it waits for the emulated GPU).")
        return f"{call}: the returned values differ from the weight's; the copy must be bitwise identical."
    if len(ops) == 0:
        return f"{call} made no copy of the data: a restore must copy the weight to host memory once."
    if len(ops) > 1:
        return (f"{call}: two copies ({len(ops)} in all): the weight went to pageable host memory first "
                "(`.to(\"cpu\")` / `.cpu()`) and was then copied again into pinned memory. Allocate the pinned "
                "destination first and copy into it once.")
    if pin and not out.is_pinned():
        return (f"{call}: this returns pageable memory: `.to(\"cpu\")` (or `empty_like` without "
                "`pin_memory=True`) allocates ordinary host memory, and the next `non_blocking` reload from it "
                "blocks the host. Ask for pinned memory when you allocate the destination.")
    if not pin and out.is_pinned():
        return (f"{call}: pin=False (the switch, like VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1) must give "
                "pageable memory, but this is pinned: pass the flag on to the allocation.")
    return None


def _call(fn, w, pin):
    with learner_call(f"restore_weight(<{tuple(w.shape)} {str(w.dtype).replace('torch.', '')} weight>, pin={pin})"):
        return fn(w, pin=pin)


def _pin_on_gpu(call: str) -> str:
    return (f"{call} asked for pinned memory on the GPU: `torch.empty_like(w, pin_memory=True)` (any `*_like` or "
            "`w.new_*`) keeps w's device, and CUDA refuses pinned GPU memory (torch raises \"Only dense CPU tensors "
            "can be pinned\"; the emulated stream refuses it too). Pinned memory is host memory: allocate the "
            "destination with `device=\"cpu\", pin_memory=pin`, then copy into it once.")


@checker
def check_restore_weight(fn) -> bool:
    """``restore_weight(w, pin=True)``: a host copy of the GPU weight ``w``, made with one copy straight
    into pinned memory (pageable with ``pin=False``), complete when it returns, aliasing nothing."""
    name = "restore_weight"
    learner_arg(name, fn, "(w, pin=True) -> tensor (the host copy of w)")
    with stream() as s:  # the emulated stream refuses what CUDA refuses (streams.py)
        show("restore_weight checked on", s.label)
        for i, (shape, dtype, pin) in enumerate(RESTORE_CASES):
            gen = torch.Generator().manual_seed(500 + i)
            expected = torch.randn(shape, generator=gen).to(dtype)  # kept alive: compared with the result
            w = expected.to(s.device)
            s.synchronize()
            s.busy(BUSY_MS)  # the GPU is behind (the emulated one always is)
            call = f"restore_weight(<{tuple(w.shape)} {str(w.dtype).replace('torch.', '')} weight on the GPU>, pin={pin})"
            try:
                out, ops = count_copies(lambda: _call(fn, w, pin))
            except LearnerStop as stop:  # it ran past its time, or left torch's state changed
                s.synchronize()
                return _fail(name, f"{name}: {stop}")
            except Exception as exc:  # the learner's bug, reported, not raised
                s.synchronize()
                if is_stub(exc, fn):
                    return not_implemented(name)
                if isinstance(exc, RuntimeError) and PIN_DEVICE_ERROR in str(exc):
                    return _fail(name, _pin_on_gpu(call))
                return _fail(name, f"{name}(w, pin={pin}) raised {raised(exc)}")
            pending = s.emulated and s.pending() > 0
            problem = _problem(s, w, expected, out, ops, pin, pending)
            s.synchronize()
            if problem:
                return _fail(name, problem)
    say(f"✅ {name} is correct ({len(RESTORE_CASES)} weights: one copy each, pinned unless pin=False, "
          "bitwise identical, ready when it returns).")
    return True


# ---- 2. pinned_footprint: what the allocator page-locks ---------------------------------------

def _footprint_cases():
    w = 4096 * 11008 * 2  # one Llama-2-7B MLP weight in bf16: 86 MiB
    cases = [
        ([w] * 4,),                              # the lesson's model
        ([1 << 20, 1 << 20],),                   # powers of two: no rounding
        ([(1 << 20) + 1],),                      # one byte over: doubled
        ([1],),                                  # the smallest block
        ([0, 4096],),                            # an empty parameter pins nothing
        ([],),                                   # no parameters
        ([3 * (1 << 20), 5 * (1 << 20)],),       # each rounded on its own, not the sum
        ([12288 * 33024 * 2] * 4,),              # the sweep's 3 GiB model: 1 GiB blocks
    ]
    rng = random.Random(5)
    for _ in range(30):
        cases.append(([rng.choice([0, rng.randint(1, 1 << 31)]) if rng.random() < 0.1 else rng.randint(1, 1 << 31)
                       for _ in range(rng.randint(1, 9))],))
    return cases


def _recorded(name: str):
    """The recorded GPU run ``name``, validated (:func:`pinlab.replay.load_recorded`: a broken file is one
    ``ReplayFileError`` sentence naming it and ``git checkout -- <file>``), or None when there is none."""
    from ..replay import load_recorded

    path = data_dir() / f"{name}.json"
    if not path.exists():
        return None
    return load_recorded(path)


@checker
def check_pinned_footprint(fn) -> bool:
    """``pinned_footprint(param_bytes)``: bytes the caching host allocator page-locks when each weight
    gets its own pinned tensor (each request rounded up to a power of two; 0 bytes pin nothing).
    Then applied to the recorded GPU run, when there is one."""
    name = "pinned_footprint"
    learner_arg(name, fn, "(param_bytes) -> int (bytes)")
    cases = _footprint_cases()
    for args in cases:
        expected = pinned_footprint(*args)
        try:
            with learner_call(f"{name}{_fmt_args(args)}"):
                got = fn(*[list(a) for a in args])
        except LearnerStop as stop:  # it ran past its time, or left torch's state changed
            return _fail(name, f"{name}: {stop}")
        except Exception as exc:
            if is_stub(exc, fn):
                return not_implemented(name)
            return _fail(name, f"{name}{_fmt_args(args)} raised {raised(exc)}")
        if not same_int(got, expected):
            why = ""
            if _number(got) is not None and _number(got) == sum(args[0]):
                why = " (that is the bytes requested: the allocator rounds every block up to a power of two)"
            elif isinstance(got, float):
                why = " (give a whole number of bytes, an int)"
            return _fail(name, f"{name}{_fmt_args(args)} returned {summary(got)}, expected {expected!r}{why}")
    say(f"✅ {name} is correct ({len(cases)} cases).")
    rec = _recorded("05_restore")
    if rec is None:
        say("   No recorded GPU run yet to apply it to (the GPU suite writes reports/gpu/data/05_restore.json).")
        return True
    res = rec["result"]
    took = res["methods"]["empty_pinned_copy"]["pinned_bytes_delta"]
    try:
        with learner_call(f"{name}(<the recorded run's {len(res['param_bytes'])} weights>)"):
            mine = fn(list(res["param_bytes"]))
    except LearnerStop as stop:
        return _fail(name, f"{name}: {stop}")
    except Exception as exc:
        return _fail(name, f"{name} on the recorded GPU run's weights raised {raised(exc)}")
    show("recorded run", f"{rec['meta'].get('gpu')}, {rec['meta'].get('date')}")
    show("your footprint for its model / the allocator took", f"{summary(mine)} / {took} bytes")
    if not same_int(mine, took):
        return _fail(name, f"on the recorded GPU run your function predicts {summary(mine)} bytes, the allocator "
                           f"took {took}.")
    say(f"✅ applied to the recorded GPU run: it predicts exactly what the allocator page-locked "
          f"({len(res['param_bytes'])} weights).")
    return True
