"""Exercise checkers for lesson 06 (build indices on the device). They run on any CPU.

Both run the learner's torch code on the emulated :class:`pinlab.LaggingStream` (exact about
order: what a GPU far behind the host would read), print one verdict line (⏳ / ❌ / ✅) in the
lesson's terms, add a 💡 hint from the second failure on, and return True or False.
``tests/test_checks_l06.py`` proves each accepts the solution and rejects planted wrong answers.

* :func:`check_rot_pos_ids`: rotary position ids built on the device without a Python loop of
  per-image launches; compared exactly with the lesson's (a) :func:`ids_before` on random grids;
  the number of torch calls must not grow with the number of images; at most one H2D copy, and
  that one pinned and ``non_blocking``; no host sync.
* :func:`check_d2h_outputs`: per-step results copied into fresh pinned buffers with
  ``non_blocking=True``, read only after their event, without waiting for more than that event.
"""
from __future__ import annotations

import random

import torch

from . import (checker, say, LearnerStop, int_list, is_stub, learner_arg, learner_call, not_implemented, raised, same_tensor,
               summary)
from ..lessons import l06_device_side_indices as l06
from ..streams import PIN_DEVICE_ERROR, LaggingStream

_FAILS: dict[str, int] = {}

HINTS = {
    "rot_pos_ids": (
        "💡 Hint: put one row per image in a small table (token count, where its tokens start, h*w, "
        "w // m), pin it and copy it once with non_blocking=True, expand it to one row per token with "
        "torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, output_size=N) (N = sum of t*h*w, "
        "known on the host), then k = (torch.arange(N, device=device) - start) % (h*w), "
        "b, r = k // m², k % m², row = (b // (w/m))·m + r // m, col = (b % (w/m))·m + r % m."),
    "d2h_outputs": (
        "💡 Hint: start_d2h: host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True); "
        "host.copy_(out, non_blocking=True); ev = s.Event(); ev.record(); return host, ev. "
        "finish_d2h: ev.synchronize(), then read host (host.tolist())."),
}


def reset_hints() -> None:
    """Forget earlier failures (the hint appears from the second failure of a checker on)."""
    _FAILS.clear()


def _fail(name: str, message: str) -> bool:
    _FAILS[name] = _FAILS.get(name, 0) + 1
    say(f"❌ {message}")
    if _FAILS[name] >= 2:
        say(HINTS[name])
    return False


# ---- exercise 1: rotary ids on the device, no Python loop over images ----------------------------


def rot_pos_cases(seed: int = 6) -> list:
    """(grid_thw, merge_size) cases: the worked example, edge cases, then random batches."""
    rng = random.Random(seed)
    cases = [([[1, 4, 6]], 2),                      # the worked example
             ([[1, 2, 2]], 2),                      # one merge block
             ([[3, 4, 2]], 2),                      # a video: every frame repeats the positions
             ([[1, 6, 4], [2, 2, 8], [1, 4, 4]], 2),  # images and a video, h != w
             ([[1, 3, 5], [2, 1, 7]], 1),           # merge size 1: plain row-major
             ([[1, 8, 12], [1, 4, 4]], 4)]          # merge size 4
    for _ in range(12):
        m = rng.choice([1, 2, 2, 2, 4])
        cases.append((l06.random_grid(rng, m, max_images=12, max_side=48), m))
    return cases


def _describe_mismatch(got: torch.Tensor, expected: torch.Tensor, grid, m) -> str:
    with torch._C.DisableTorchFunctionSubclass():  # a tensor subclass's own __torch_function__ does not decide
        return _mismatch(got, expected, grid, m)


def _mismatch(got: torch.Tensor, expected: torch.Tensor, grid, m) -> str:
    if tuple(got.shape) != tuple(expected.shape):
        n_frame = sum(h * w for _, h, w in grid)
        if got.dim() == 2 and got.shape[0] == n_frame and n_frame != expected.shape[0]:
            return (f"returned {got.shape[0]} rows, expected {expected.shape[0]} = Σ t·h·w: every frame of a "
                    f"video repeats the same 2-D positions (repeat over t)")
        return f"returned shape {list(got.shape)}, expected {list(expected.shape)} ([Σ t·h·w, 2]: row, column)"
    if torch.equal(got.flip(-1), expected):
        return "returned (column, row) pairs: vLLM stacks [hpos, wpos], the row first"
    plain = l06.ids_before(grid, 1, "cpu")
    if m > 1 and torch.equal(got, plain):
        return ("returned the positions row by row: Qwen2-VL orders tokens block by block (all m×m tokens "
                "of merge block (0, 0) first, then block (0, 1), ...)")
    bad = int((got != expected).any(-1).nonzero()[0, 0])
    return (f"token {bad}: got {got[bad].tolist()}, expected {expected[bad].tolist()} "
            f"(b = k // m², r = k % m², row = (b // (w/m))·m + r // m, col = (b % (w/m))·m + r % m)")


class _MixedDevices(Exception):
    """The learner's code gave an op device tensors and a host tensor (the emulation, as a GPU, refused it):
    ``call`` is :class:`l06.TorchCalls`'s record of that call."""

    def __init__(self, call: dict):
        super().__init__(call["call"])
        self.call = call


def _mixed_message(where: str, c: dict) -> str:
    return (f"{where}: `{c['call']}` got device tensors and a host tensor of shape {c['shape']} "
            f"that was never copied to the device: a GPU refuses that (\"Expected all tensors to "
            f"be on the same device\"). Copy the small table to the device once, pinned and "
            f"non_blocking=True (.pin_memory().to(device, non_blocking=True)), and build the "
            f"rest from that copy")


def _run_emulated(fn, grid, m):
    """Run ``fn(grid, m, device)`` on a fresh LaggingStream (with CUDA's rules: ``device="cpu"`` is the host)
    under a call counter. Where the emulation refuses a call that mixed device and host tensors (as a GPU
    does), raises :class:`_MixedDevices` naming the call, so that the learner gets the advice, not torch's error."""
    with LaggingStream() as s:
        with l06.TorchCalls(s) as calls:
            try:
                with learner_call(f"rot_pos_ids({grid if len(grid) <= 3 else f'<{len(grid)} rows>'}, m={m}, device)"):
                    out = fn([list(r) for r in grid], m, s.device)
            except RuntimeError as exc:
                if calls.mixed and "Expected all tensors to be on the same device" in str(exc):
                    raise _MixedDevices(calls.mixed[0]) from exc
                raise
        # device memory, or made from device factories (the emulation loses track of a reshape
        # that copies, so ids built with torch.arange(..., device=device) count as on the device)
        on_device = isinstance(out, torch.Tensor) and (s.is_device(out) or calls.device_factories > 0
                                                        or bool(calls.h2d))
        s.synchronize()
    return out, on_device, calls


@checker
def check_rot_pos_ids(fn) -> bool:
    """``rot_pos_ids(grid_thw, m, device)`` -> int64 ``[Σ t·h·w, 2]`` on ``device``, no Python loop
    of per-image launches, at most one (pinned, ``non_blocking``) H2D copy, no host sync."""
    name = "rot_pos_ids"
    learner_arg(name, fn, "(grid_thw, m, device) -> tensor of int64 ids [Σ t·h·w, 2]")
    n = 0
    for grid, m in rot_pos_cases():
        expected = l06.ids_before(grid, m, "cpu")
        try:
            got, on_device, calls = _run_emulated(fn, grid, m)
        except LearnerStop as stop:  # it ran past its time, or left torch's state changed
            return _fail(name, f"{name}: {stop}")
        except _MixedDevices as exc:  # a GPU (and the emulation) refuses it: say why and what to do
            return _fail(name, _mixed_message(
                f"{name}(grid_thw={grid if len(grid) <= 3 else f'{len(grid)} rows'}, m={m})", exc.call))
        except Exception as exc:  # the learner's bug, reported, not raised
            if is_stub(exc, fn):
                return not_implemented(name)
            return _fail(name, f"{name}({grid}, m={m}) raised {raised(exc)}"[:400])
        where = f"{name}(grid_thw={grid if len(grid) <= 3 else f'{len(grid)} rows'}, m={m})"
        if calls.default_device is not None:
            return _fail(name, f"{where} set torch's default device (torch.set_default_device("
                               f"{calls.default_device})): a switch for the whole program, which every later "
                               f"torch call sees (other code's new tensors land there too, and torch warns that "
                               f"it slows every torch call). Pass the device you were given to each factory "
                               f"instead: torch.arange(..., device=device)")
        if calls.mixed:
            return _fail(name, _mixed_message(where, calls.mixed[0]))
        if not isinstance(got, torch.Tensor):
            return _fail(name, f"{where} returned {type(got).__name__}, expected a torch.Tensor of ids")
        if got.dtype.is_floating_point:
            return _fail(name, f"{where} returned {got.dtype} ids: use // (floor division) so that the "
                               f"ids stay integers (they index the cos/sin table)")
        if got.dtype != torch.int64:
            return _fail(name, f"{where} returned {got.dtype} ids, expected torch.int64 (as torch.arange makes them)")
        if not same_tensor(got, expected):
            return _fail(name, f"{where} {_describe_mismatch(got, expected, grid, m)}")
        if not on_device:
            return _fail(name, f"{where}: the ids are host memory; build them with device=device "
                               f"(torch.arange(..., device=device)) so that no copy of them is needed")
        if calls.syncs:
            return _fail(name, f"{where} read a device value on the host ({calls.syncs[0]}): a hidden sync "
                               f"that makes the host wait for the GPU; the host already knows N = Σ t·h·w "
                               f"(pass output_size)")
        blocking = [c for c in calls.h2d if c["kind"] != "pinned"]
        if blocking:
            c = blocking[0]
            why = ("a blocking copy: the host waits for the GPU" if c["kind"] == "blocking"
                   else "non_blocking from pageable memory: the driver stages it, it is not truly asynchronous")
            return _fail(name, f"{where} copied to the device with {c['call']}, {why}; pin the host tensor "
                               f"first (.pin_memory()) and copy it with non_blocking=True")
        if len(calls.h2d) > 1:
            return _fail(name, f"{where} made {len(calls.h2d)} H2D copies: copy one small table for all "
                               f"images, once")
        n += 1
    few, many = [[1, 4, 4], [2, 6, 2]], [[1, 4, 4], [2, 6, 2]] * 8
    try:
        _, _, c_few = _run_emulated(fn, few, 2)
        _, _, c_many = _run_emulated(fn, many, 2)
    except LearnerStop as stop:
        return _fail(name, f"{name}: {stop}")
    except Exception as exc:
        return _fail(name, f"{name}({many}, m=2) raised {raised(exc)}"[:400])
    # the same images, 16 times the tokens: the copy must not grow (one small row per image)
    big = [[t, 4 * h, 4 * w] for t, h, w in few]
    try:
        _, _, c_big = _run_emulated(fn, big, 2)
    except LearnerStop as stop:
        return _fail(name, f"{name}: {stop}")
    except Exception as exc:
        return _fail(name, f"{name}({big}, m=2) raised {raised(exc)}"[:400])
    copied = {n_tokens: sum(c["nbytes"] for c in cs.h2d)
              for n_tokens, cs in ((_tokens(few), c_few), (_tokens(big), c_big))}
    if copied[_tokens(big)] > copied[_tokens(few)]:
        return _fail(name, f"{name} copied {copied[_tokens(few)]} bytes to the device for the {_tokens(few)} tokens of "
                           f"{few} and {copied[_tokens(big)]} bytes for the {_tokens(big)} tokens of {big}, the same "
                           f"{len(few)} images: the copy grows with the tokens, so the ids (or a table with a row per "
                           f"token) were built on the host and copied. Build them on the device "
                           f"(torch.arange(N, device=device) and the closed form), from a table with one row per image")
    if c_many.calls > c_few.calls + 2:
        return _fail(name, f"{name} made {c_few.calls} torch calls for {len(few)} images and {c_many.calls} "
                           f"for {len(many)}: the calls grow with the images, so there is a Python loop of "
                           f"per-image launches (one launch chain per image, the PR's (b)); build every "
                           f"image's ids at once")
    if torch.cuda.is_available():  # and for real on the GPU
        for grid, m in rot_pos_cases()[:6]:
            try:
                with learner_call(f"{name}({grid}, m={m}, device='cuda')"):
                    got = fn([list(r) for r in grid], m, torch.device("cuda"))
                same = isinstance(got, torch.Tensor) and got.device.type == "cuda" and same_tensor(
                    got.cpu(), l06.ids_before(grid, m, "cpu"))
            except LearnerStop as stop:
                return _fail(name, f"{name}: {stop}")
            except Exception as exc:
                return _fail(name, f"{name}({grid}, m={m}, device='cuda') raised {raised(exc)}"[:400])
            if not same:
                return _fail(name, f"{name}({grid}, m={m}, device='cuda') did not return the ids on the GPU, "
                                   f"equal to (a)")
    say(f"✅ {name} is correct ({n} grids equal to (a); {c_many.calls} torch calls for {len(many)} images "
          f"as for {len(few)}; no more bytes copied for {_tokens(big)} tokens than for {_tokens(few)}; checked on the "
          f"emulated lagging stream, and on CUDA where there is one).")
    return True


def _tokens(grid) -> int:
    return sum(t * h * w for t, h, w in grid)


# ---- exercise 2: per-step results copied D2H into pinned memory, read after their event ----------


def _steps_cases():
    return [(6, 4), (9, 16), (5, 1)]


@checker
def check_d2h_outputs(start_d2h, finish_d2h) -> bool:
    """``start_d2h(s, out)`` -> ``(host, event)``: a fresh pinned host tensor with ``out``'s copy
    queued (``non_blocking``) and an event recorded after it; ``finish_d2h(host, event)`` -> the
    values (list or tensor), read only after the event, waiting for nothing more."""
    learner_arg("start_d2h", start_d2h, "(s, out) -> (host, event)")
    learner_arg("finish_d2h", finish_d2h, "(host, event) -> the values (a list or a tensor)")
    name = "d2h_outputs"
    n_steps_total = 0
    for steps, width in _steps_cases():
        try:
            verdict = _run_d2h(start_d2h, finish_d2h, steps, width)
        except LearnerStop as stop:  # it ran past its time, or left torch's state changed
            return _fail(name, f"{name}: {stop}")
        except _NotValues as exc:
            return _fail(name, str(exc))
        except Exception as exc:
            if is_stub(exc, start_d2h, finish_d2h):
                return not_implemented(name)
            if isinstance(exc, RuntimeError) and PIN_DEVICE_ERROR in str(exc):
                return _fail(name, "start_d2h asked for pinned memory on the GPU: `torch.empty_like(out, "
                                   "pin_memory=True)` (any `*_like` or `out.new_*`) keeps out's device, and CUDA "
                                   "refuses pinned GPU memory (torch raises \"Only dense CPU tensors can be "
                                   "pinned\"; the emulated stream refuses it too). Pinned memory is host memory: "
                                   "torch.empty(out.shape, dtype=out.dtype, pin_memory=True)")
            return _fail(name, f"{name} raised {raised(exc)}"[:400])
        if verdict is not None:
            return _fail(name, verdict)
        n_steps_total += steps
    say(f"✅ {name} is correct ({n_steps_total} steps, every result read after its event, the host never "
          f"waited for more; checked on the emulated lagging stream).")
    return True


class _NotValues(Exception):
    pass


def _as_values(v, m: int):
    """finish_d2h's answer (a list, tuple or tensor of ints) as a list of Python ints: its type is
    checked first, so that no object of the learner's decides the comparison."""
    try:
        return int_list(v)
    except TypeError:
        raise _NotValues(f"step {m}: finish_d2h returned {summary(v, 80)}, expected the step's values as a list "
                         "of ints or a tensor (host.tolist(), or host itself)") from None


def _run_d2h(start_d2h, finish_d2h, steps: int, width: int):
    """Drive a step loop two steps deep on a LaggingStream (which refuses what CUDA refuses); None if all is well, else a message."""
    with LaggingStream() as s:
        base = torch.arange(width, dtype=torch.int64, device=s.device)
        pending = []
        results = {}
        waited = {}   # step -> finish_d2h waited for queued work (its event was not reached yet)
        ran = set()
        for n in range(steps):
            out = torch.empty(width, dtype=torch.int64, device=s.device)
            torch.add(base, 1000 * (n + 1), out=out)            # step n's result, computed on the GPU
            s.busy(1.0)
            s.launch(ran.add, n)                                 # marks the moment step n's work has run
            with learner_call(f"start_d2h(s, out) at step {n}"):
                got = start_d2h(s, out)
            if not (isinstance(got, tuple) and len(got) == 2):
                return "start_d2h must return (host_tensor, event)"
            host, ev = got
            if not isinstance(host, torch.Tensor) or s.is_device(host):
                return f"step {n}: start_d2h returned {type(host).__name__} on the device, expected a host tensor"
            if not s.is_pinned(host):
                return (f"step {n}: start_d2h's host buffer is pageable memory (`.cpu()`, `.to(\"cpu\")` or a "
                        f"tensor made without pin_memory=True): a D2H copy into pageable memory, non_blocking or "
                        f"not, waits for the GPU; allocate a fresh buffer with pin_memory=True and copy into it "
                        f"with non_blocking=True")
            if n in ran:
                return (f"step {n}: start_d2h waited for the GPU (its work was done when it returned): a "
                        f"pageable non_blocking D2H copy, .cpu() or .tolist() waits for all earlier work "
                        f"(10.5 ms behind a 10 ms kernel on the H200); queue the copy and return at once")
            for m, (h, _) in pending:
                if h.untyped_storage().data_ptr() == host.untyped_storage().data_ptr():
                    return (f"step {n}: start_d2h reused step {m}'s pinned buffer while step {m} was not "
                            f"read yet: step {n}'s copy overwrites it (the race of lesson 03); take a fresh "
                            f"buffer every step")
            pending.append((n, (host, ev)))
            if len(pending) > 1:  # the host reads step n-1 while step n is in flight
                m, (h, e) = pending.pop(0)
                before = s.pending()
                with learner_call(f"finish_d2h(host, event) for step {m}"):
                    values = finish_d2h(h, e)
                waited[m] = s.pending() < before
                values = _as_values(values, m)
                if n in ran:
                    return (f"step {m}: finish_d2h waited for the whole stream (step {n} had finished too): "
                            f"wait only for this step's event, so that the next steps stay queued")
                results[m] = values
        for m, (h, e) in pending:
            before = s.pending()
            with learner_call(f"finish_d2h(host, event) for step {m}"):
                values = finish_d2h(h, e)
            waited[m] = s.pending() < before
            results[m] = _as_values(values, m)
        s.synchronize()
    for m in range(steps):
        expected = [1000 * (m + 1) + i for i in range(width)]
        if results.get(m) != expected:
            got = results.get(m)
            if waited.get(m):  # it did wait, for an event that did not follow the copy
                return (f"step {m}: finish_d2h returned {str(got)[:60]}, expected {str(expected)[:60]}: it "
                        f"waited for the event, but the pinned buffer's copy had not run yet: the event was "
                        f"recorded before the copy was queued (it marks the work before it). In start_d2h, "
                        f"record the event after host.copy_(out, non_blocking=True)")
            return (f"step {m}: finish_d2h returned {str(got)[:60]}, expected {str(expected)[:60]}: it read "
                    f"the pinned buffer before its copy had run; call event.synchronize() first")
    return None
