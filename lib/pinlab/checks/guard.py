"""The learner's call, guarded: its argument check, its time limit, and torch's global state around it.

:func:`learner_call` runs the learner's code at most :func:`timeout_s` seconds and restores torch's global
state after it (default device and dtype, threads, grad mode, ``PINLAB_*`` environment variables); either
problem stops the call with :class:`LearnerStop`. :func:`is_stub` tells the exercise's stub from a
``NotImplementedError`` raised deeper. Part of the checkers' core (:mod:`pinlab.checks`), with
:mod:`.compare` and :mod:`.verdict`.
"""
from __future__ import annotations

import dis
import math
import numbers
import os
import signal
import threading
import time
from contextlib import contextmanager

import torch

from ..detector import SKIP_PREFIXES
from ..streams import explain_dummy_event

# =============================================================================================
# The learner's function: its argument check, its time limit, torch's global state around it
# =============================================================================================

#: Seconds one call of the learner's code may run before the checker stops it. The solutions take
#: well under a second per call (on the emulated stream on a 2-core CPU and on the H200), the
#: capstone's 1000-step loop about 5 s on that CPU; its checker adds time per step.
TIMEOUT_S = 60.0
#: The environment variable that overrides every checker's time limit (seconds; the tests set it low).
TIMEOUT_ENV = "PINLAB_CHECK_TIMEOUT_S"


def timeout_s(default: float | None = None) -> float:
    """The time limit of one learner call: ``PINLAB_CHECK_TIMEOUT_S`` when set, else ``default``
    (a checker's own), else :data:`TIMEOUT_S`."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
        return value
    value = TIMEOUT_S if default is None else default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"the time limit must be a positive number of seconds, got {value!r}")
    return float(value)


def learner_arg(name: str, fn, signature: str):
    """Check that the learner handed a function: TypeError ``"<name> must be a function <signature>,
    got <type>"`` otherwise (``signature`` such as ``"(nbytes, ms) -> float"``)."""
    if not callable(fn):
        raise TypeError(f"{name} must be a function {signature}, got {type(fn).__name__}")
    return fn


class LearnerStop(BaseException):
    """A call of the learner's code stopped by the checker: it ran past its time limit, or it left
    torch's global state changed. ``str()`` is the verdict (without the "❌ name: " prefix).

    A BaseException, so that an ``except Exception`` in the learner's loop cannot swallow it."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def as_error(self) -> Exception:
        """The same text as an ordinary exception (for callers that report, not judge)."""
        return (TimeoutError if "did not return within" in self.text else RuntimeError)(self.text)


def _timeout_text(seconds: float, what: str) -> str:
    call = f" ({what})" if what else ""
    return (f"your function did not return within {seconds:g} s{call}: a loop that never ends? On the emulated "
            "stream the GPU is always behind the host and runs its queue only when the host waits for it: "
            "`ev.synchronize()`, a loop on `ev.query()` or `s.synchronize()` (each counts as a wait where an "
            "exercise asks for none). A loop that watches memory instead, for a copy's data to arrive, waits "
            "there forever: wait on an event recorded after the copy.")


class _Timer:
    """SIGALRM after ``seconds`` (then every second until left): raises :class:`LearnerStop` in the
    main thread, where notebook cells run; the previous handler and timer are restored on leaving.
    Where there is no SIGALRM (Windows) or outside the main thread (signals reach only the main
    thread), the call runs unbounded: nothing else can interrupt a Python loop safely."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what
        self.armed = self.active = False

    def _fire(self, signum, frame):
        if self.active:
            raise LearnerStop(_timeout_text(self.seconds, self.what))

    def __enter__(self):
        if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            return self  # unbounded (see the class docstring)
        self.t0 = time.monotonic()
        self.prev_handler = signal.signal(signal.SIGALRM, self._fire)
        self.active = self.armed = True
        # the interval: a learner's `except BaseException` that swallows one stop meets the next
        self.prev_timer = signal.setitimer(signal.ITIMER_REAL, self.seconds, min(1.0, self.seconds))
        return self

    def __exit__(self, *exc):
        self.active = False
        if not self.armed:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.prev_handler if self.prev_handler is not None else signal.SIG_DFL)
        delay, interval = self.prev_timer
        if delay > 0:  # an enclosing timer (a bounded call around this one, pytest's): what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - self.t0), 1e-6), interval)


def _device_context():
    """torch's global default-device context (``torch.set_default_device``), or None."""
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


def _mode_stack() -> list:
    try:
        from torch.overrides import _get_current_function_mode_stack
        return list(_get_current_function_mode_stack())
    except Exception:  # a torch without it: the mode stack is not checked
        return []


def _default_device(modes) -> str:
    """What ``torch.get_default_device()`` answers, read without creating a tensor."""
    from torch.utils._device import DeviceContext

    for mode in reversed(modes):
        if isinstance(mode, DeviceContext):
            return str(mode.device)
    ctx = _device_context()
    return str(ctx.device) if ctx is not None else "cpu"


def _drop_modes(extra: list) -> None:
    """Take the torch function modes ``extra`` off the mode stack, the others staying in order. A
    DeviceContext entered through its ``__enter__`` (it keeps the device it replaced) leaves through
    its ``__exit__``; one that ``with torch.device(...)`` pushed, and any other mode, is taken off."""
    from torch.overrides import _len_torch_function_stack, _pop_mode, _push_mode
    from torch.utils._device import DeviceContext

    for mode in reversed(extra):
        if isinstance(mode, DeviceContext) and hasattr(mode, "old_device"):
            mode.__exit__(None, None, None)
    stack = [_pop_mode() for _ in range(_len_torch_function_stack())][::-1]  # bottom first
    for mode in stack:
        if not any(mode is m for m in extra):
            _push_mode(mode)


def _pinlab_env() -> dict:
    """The ``PINLAB_*`` environment variables (read from os.environ's own table: decoding every key
    would cost more than the rest of a learner call's bookkeeping)."""
    data = getattr(os.environ, "_data", None)
    decode = getattr(os.environ, "decodekey", None)
    if isinstance(data, dict) and callable(decode):
        prefix = b"PINLAB_" if data and isinstance(next(iter(data)), bytes) else "PINLAB_"
        keys = [decode(k) for k in data if k.startswith(prefix)]
        return {k: os.environ[k] for k in keys}
    return {k: v for k, v in os.environ.items() if k.startswith("PINLAB_")}


class _TorchState:
    """torch's global state a learner's function could leave changed: default device, default dtype,
    number of threads, grad mode, the ``PINLAB_*`` environment variables (and torch function modes
    entered and never left)."""

    def __init__(self):
        self.modes = _mode_stack()
        self.ctx = _device_context()
        self.device = _default_device(self.modes)
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.grad = torch.is_grad_enabled()
        self.env = _pinlab_env()

    def restore(self) -> list[str]:
        """Put everything back as it was; return what had changed, in words."""
        changed = []
        modes = _mode_stack()
        device = _default_device(modes)
        if device != self.device:
            changed.append(f"torch's default device to {device}")
        elif (_device_context() is None) != (self.ctx is None):
            # the same name, another setting: torch.set_default_device(s.device) on the emulated stream,
            # whose GPU is named "cpu" (on a GPU it would read "to cuda:0")
            changed.append(f"torch's default device (torch.set_default_device({device}))")
        if _device_context() is not self.ctx:
            torch.set_default_device(self.ctx.device if self.ctx is not None else None)
        ctx = _device_context()
        extra = [m for m in _mode_stack() if m is not ctx and not any(m is b for b in self.modes)]
        if extra:  # entered by the learner's code and never left
            _drop_modes(extra)
        if extra and device == self.device:
            changed.append(f"torch's function mode stack (a {type(extra[0]).__name__} entered and never left)")
        dtype = torch.get_default_dtype()
        if dtype != self.dtype:
            changed.append(f"torch's default dtype to {str(dtype).replace('torch.', '')}")
            torch.set_default_dtype(self.dtype)
        threads = torch.get_num_threads()
        if threads != self.threads:
            changed.append(f"torch's number of threads to {threads} (torch.set_num_threads)")
            torch.set_num_threads(self.threads)
        grad = torch.is_grad_enabled()
        if grad != self.grad:
            changed.append(f"grad mode to {'on' if grad else 'off'} (torch.set_grad_enabled({grad}))")
            torch.set_grad_enabled(self.grad)
        env = _pinlab_env()
        for key in sorted(set(env) | set(self.env)):
            old, new = self.env.get(key), env.get(key)
            if old == new:
                continue
            changed.append(f"the environment variable {key} ({'removed' if new is None else f'set to {new!r}'})")
            if old is None:
                del os.environ[key]
            else:
                os.environ[key] = old
        return changed


def _leak_text(changed: list[str]) -> str:
    it = "it" if len(changed) == 1 else "them"
    return (f"your function changed {' and '.join(changed)} and did not restore {it}; the checker restored "
            f"{it}, but in a notebook the code after your function would run with {it} changed. Set {it} back "
            "before returning (`with torch.device(...):`, `with torch.no_grad():`, or try/finally).")


@contextmanager
def learner_call(what: str = "", seconds: float | None = None):
    """Run the learner's code inside this block: stopped with :class:`LearnerStop` after
    :func:`timeout_s` seconds (``seconds``: the checker's own default), and torch's global state
    restored when it ends; a block that ends normally but changed that state raises
    :class:`LearnerStop` naming the change. ``what`` describes the call for the verdict.
    ``torch.cuda.Event()`` made where CUDA is missing and no emulated stream is active (torch's
    "Tried to instantiate dummy base class Event") comes out as a RuntimeError pointing to ``s.Event()``
    (:func:`pinlab.streams.explain_dummy_event`)."""
    limit = timeout_s(seconds)
    state = _TorchState()
    ok = False
    try:
        with _Timer(limit, what):
            try:
                yield
            except RuntimeError as exc:  # torch.cuda.Event() on a CPU-only torch: say what to use instead
                clear = explain_dummy_event(exc)
                if clear is None:
                    raise
                raise clear from exc
        ok = True
    finally:
        changed = state.restore()
    if ok and changed:
        raise LearnerStop(_leak_text(changed))


def _codes(fns) -> set:
    """The code objects of the learner's functions (through partials, methods, wrappers)."""
    out, todo = set(), list(fns)
    for _ in range(64):
        if not todo:
            break
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is not None:
            out.add(code)
        for attr in ("func", "__func__", "__wrapped__"):
            inner = getattr(f, attr, None)
            if inner is not None and inner is not f:
                todo.append(inner)
        call = getattr(type(f), "__call__", None)
        if call is not None and getattr(call, "__code__", None) is not None:
            out.add(call.__code__)
    return out


def _raise_site(exc):
    """``(code, line, by_raise)`` of the innermost frame of ``exc``'s traceback: ``by_raise`` when a
    ``raise`` statement of that frame raised it, False when a call made there (torch's C++) did.
    None without a traceback."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    op = next((i.opname for i in dis.get_instructions(code) if i.offset == tb.tb_lasti), None)
    return code, tb.tb_lineno, op in (None, "RAISE_VARARGS")  # not found (another Python): a raise


def is_stub(exc: BaseException, *fns) -> bool:
    """True when ``exc`` is the exercise's stub saying "not implemented yet": a NotImplementedError
    raised by a ``raise`` statement in the body of one of the learner's functions ``fns``, or the
    stub's bare ``raise NotImplementedError`` (``tools/make_exercises.py``) elsewhere in the learner's
    own code (a wrapper around the stub, a helper still to write). One raised deeper with a message
    (torch's unsupported op, even when called straight from the learner's function; a helper's
    deliberate error) is an error, not a missing answer."""
    if not isinstance(exc, NotImplementedError):
        return False
    site = _raise_site(exc)
    if site is None:
        return True
    code, _, by_raise = site
    if not by_raise:
        return False
    if code in _codes(fns):
        return True
    return type(exc) is NotImplementedError and not exc.args and not code.co_filename.startswith(SKIP_PREFIXES)


def raised(exc: BaseException) -> str:
    """``"TypeName: message"`` of an exception from the learner's code; a NotImplementedError that is
    not the stub's says where it came from."""
    text = f"{type(exc).__name__}: {exc}"
    site = _raise_site(exc) if isinstance(exc, NotImplementedError) else None
    if site is not None:
        code, line, by_raise = site
        if code.co_filename.startswith(SKIP_PREFIXES):  # torch's Python, or the emulation's handling of a torch call
            yours = _innermost_outside_library(exc.__traceback__)
            where = "inside torch" + (f", called in {yours[0]}() (line {yours[1]})" if yours else "")
        elif not by_raise:
            where = f"by an operation called in {code.co_name}() (line {line}) that does not support its arguments"
        else:
            where = f"inside {code.co_name}()"
        text += f" (raised {where}, not by the exercise's stub: an error to fix, not a missing answer)"
    return text


def _innermost_outside_library(tb):
    """``(function name, line)`` of the innermost traceback frame outside torch and pinlab, or None."""
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(SKIP_PREFIXES):
            found = (code.co_name, tb.tb_lineno)
        tb = tb.tb_next
    return found

