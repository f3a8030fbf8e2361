"""Exercise checkers: each runs the learner's function on cases and compares with a reference.

A checker prints one verdict line and returns True or False:

* ``⏳ ... not implemented yet`` when the stub still raises ``NotImplementedError``;
* ``❌ ...`` with the first failing case (arguments, what came back, what was expected; long
  lists and tensors are summarised: length or shape, first and last values, and the first
  entry where the answer differs), followed by ``💡 Hint: ...`` from the second failure of the
  same checker on, when the checker gives a hint;
* ``✅ ...`` when every case passes.

Lesson checkers (``checks/lNN.py``) call :func:`run_cases`; their compare functions can use
:func:`as_int` / :func:`same_int` so that a numpy or tensor integer counts as the int it is.
``tests/test_checks_lNN.py`` proves each checker accepts the solution and rejects planted
wrong answers.

Every call of the learner's code is made inside :func:`learner_call`: it runs at most
:func:`timeout_s` seconds (:data:`TIMEOUT_S`, or the environment variable ``PINLAB_CHECK_TIMEOUT_S``),
and torch's global state (default device and dtype, number of threads, grad mode, ``PINLAB_*``
environment variables) is restored after it; either problem stops the call with
:class:`LearnerStop`, whose text the checker prints as its ❌ verdict. :func:`learner_arg` names
the learner's function and its signature when it is not a function. Answers are
compared by their type first (:func:`_close`, :func:`as_int`, :func:`int_list`, :func:`same_tensor`):
no object of the learner's decides a comparison through its own ``__eq__``. :func:`is_stub` tells
the exercise's stub (``raise NotImplementedError``, ⏳) from a ``NotImplementedError`` raised deeper
(torch's unsupported op, a helper: ❌). ``tests/test_checks_core.py`` proves each of these.

(About 650 lines: the learner-call guard, the type-first comparisons and the summaries of answers
are the one core every checker shares; each lesson's checkers use all three.)
"""
from __future__ import annotations

import copy
import dis
import math
import numbers
import os
import signal
import threading
import time
from contextlib import contextmanager

import torch

from ..args import text_arg
from ..timing import wrapped
from ..detector import SKIP_PREFIXES
from ..streams import explain_dummy_event

#: Failures so far per checker name (reset when it passes): the hint shows from the second on.
_FAILURES: dict[str, int] = {}

_SHOW = 3  # first and last values shown of a long list or tensor

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


# =============================================================================================
# Comparing answers: the type first, then the value; no learner object's __eq__ decides
# =============================================================================================


def _is_array(value) -> bool:
    """A torch tensor or a numpy array/scalar (the only objects whose .item()/.tolist() we trust)."""
    return isinstance(value, torch.Tensor) or type(value).__module__.partition(".")[0] == "numpy"


def as_int(value) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a one-element integer tensor/array.

    A bool, a float (even 5.0) or anything else is a TypeError: the answer should be a count.
    """
    if isinstance(value, bool):
        raise TypeError(f"expected an int, got a bool ({value!r})")
    if isinstance(value, numbers.Integral):
        return int(value)  # an exact int, whatever the learner's class says
    dtype = getattr(value, "dtype", None) if _is_array(value) else None
    if dtype is not None and hasattr(value, "item") and _numel(value) == 1:
        is_float = getattr(dtype, "is_floating_point", None)
        kind = getattr(dtype, "kind", None)  # numpy
        if kind in ("i", "u") or (is_float is False and not getattr(dtype, "is_complex", False)
                                  and str(dtype) != "torch.bool"):
            return int(value.item())
    raise TypeError(f"expected an int, got {type(value).__name__} ({_summary(value)})")


def same_int(got, expected) -> bool:
    """True when ``got`` is an integer (Python, numpy or a one-element tensor) equal to ``expected``."""
    try:
        return as_int(got) == expected
    except TypeError:
        return False


def int_list(value) -> list[int]:
    """A learner's list of integers (list, tuple, numpy array or tensor; whole floats count) as a
    list of Python ints; TypeError for anything else (a bool, a non-whole number, another object)."""
    if _is_array(value) and len(getattr(value, "shape", ())) >= 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of ints, got {type(value).__name__}")
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"expected an int, got {type(x).__name__}")
        f = float(x)
        if not f.is_integer():
            raise TypeError(f"expected an int, got {f!r}")
        out.append(int(x) if isinstance(x, numbers.Integral) else int(f))
    return out


def same_tensor(got, expected, *, rtol: float | None = None, atol: float = 0.0) -> bool:
    """``got`` is a tensor of ``expected``'s shape equal to it (``rtol``: close instead); a tensor
    subclass's ``__torch_function__`` does not decide (torch function modes still see the call)."""
    if not isinstance(got, torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        if tuple(got.shape) != tuple(expected.shape):
            return False
        if rtol is None:
            return bool(torch.equal(got, expected))
        return bool(torch.allclose(got, expected, rtol=rtol, atol=atol))


def _numel(value) -> int:
    n = getattr(value, "numel", None)
    if callable(n):
        return int(n())
    return int(getattr(value, "size", 0))


def _number(value):
    """A float for a real number (Python, numpy, one-element tensor), None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        try:
            return float(value)  # an exact float, whatever the learner's class says
        except Exception:
            return None
    if _is_array(value) and hasattr(value, "item") and _numel(value) == 1:
        item = value.item()
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            return float(item)
    return None


def _seq(value):
    """A list-like answer (list, tuple, 1-d+ tensor or array) as a list, anything else None."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if _is_array(value) and hasattr(value, "tolist") and len(getattr(value, "shape", ())) >= 1:
        return value.tolist()
    return None


def _close(a, b, rel=1e-6) -> bool:
    """``a`` (the learner's answer) matches ``b`` (the reference's): the type first, then the value.

    Numbers within ``rel`` (numpy and tensor scalars count; a bool is not a number); ``None`` only
    by ``None``; lists and tuples entry by entry (a list, tuple, tensor or array of the same length);
    a tensor by :func:`same_tensor`; anything else must be an instance of the reference's type, and
    the reference's type's ``__eq__`` decides. No learner object's ``__eq__`` is ever called
    (``unittest.mock.ANY`` equals nothing here)."""
    y = _number(b)
    if y is not None:
        x = _number(a)
        return x is not None and math.isclose(x, y, rel_tol=rel, abs_tol=1e-12)
    if b is None:
        return a is None
    if isinstance(b, bool):
        return (isinstance(a, bool) or type(a).__name__ in ("bool_", "bool") and _is_array(a)) and bool(a) is b
    if isinstance(b, torch.Tensor):
        return same_tensor(a, b)
    if isinstance(b, (list, tuple)):
        seq = _seq(a)
        return seq is not None and len(seq) == len(b) and all(_close(x, y, rel) for x, y in zip(seq, b))
    if isinstance(b, dict):
        return (isinstance(a, dict) and len(a) == len(b) and all(k in b for k in a)
                and all(_close(a[k], b[k], rel) for k in b))
    try:
        return isinstance(a, type(b)) and type(b).__eq__(b, a) is True
    except Exception:  # a broken __eq__
        return False


# =============================================================================================
# Showing answers
# =============================================================================================


def _repr(value, width: int) -> str:
    """``repr(value)``; for an object of the learner's (not a builtin), bounded in time, and
    ``<TypeName object>`` when its repr fails."""
    if _plain(value) or _is_array(value):
        text = repr(value)
    else:
        try:
            with learner_call("repr() of your answer", 5.0):
                text = repr(value)
            if not isinstance(text, str):
                raise TypeError
        except (Exception, LearnerStop):
            text = f"<{type(value).__name__} object>"
    if len(text) > width:
        return text[: width - 20] + f"... ({len(text)} chars)"
    return text


def _summary(value, width: int = 120, depth: int = 0) -> str:
    """``repr`` of ``value``, summarised when long: shape/length, first and last values."""
    if _is_array(value) and hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "tolist"):
        shape = tuple(value.shape)
        kind = type(value).__name__
        dtype = str(value.dtype).replace("torch.", "")
        if _numel(value) <= 2 * _SHOW:
            try:
                return f"{kind}({value.tolist()!r}, dtype={dtype})"
            except Exception:  # a meta tensor has no values
                return f"{kind}(shape={shape}, dtype={dtype})"
        try:
            flat = value.reshape(-1).tolist()
        except Exception:
            return f"{kind}(shape={shape}, dtype={dtype})"
        return f"{kind}(shape={shape}, dtype={dtype}: {_ends(flat, width, depth)})"
    if type(value) in (list, tuple):
        if _plain(value):
            text = repr(value)
        elif len(value) <= 4 * _SHOW and depth < 2:  # an object of the learner's inside: each one summarised
            text = ", ".join(_summary(v, width, depth + 1) for v in value)
            text = f"[{text}]" if isinstance(value, list) else f"({text}{',' if len(value) == 1 else ''})"
        else:
            text = None
        if text is not None and len(text) <= width and len(value) <= 4 * _SHOW:
            return text
        return _ends(value, width, depth) + f" (len {len(value)})"
    return _repr(value, width)


_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _plain(value, depth: int = 0) -> bool:
    """Made of builtin scalars, lists, tuples and dicts only (its repr runs no learner code)."""
    if type(value) in _PLAIN:
        return True
    if depth > 8:
        return False
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _ends(seq, width, depth) -> str:
    seq = list(seq)
    inner = max(24, width // 3)
    if depth >= 2:
        return f"[... {len(seq)} items]"
    parts = [_summary(v, inner, depth + 1) for v in seq[:_SHOW]]
    if len(seq) > 2 * _SHOW:
        parts.append("...")
        parts += [_summary(v, inner, depth + 1) for v in seq[-_SHOW:]]
    else:
        parts += [_summary(v, inner, depth + 1) for v in seq[_SHOW:]]
    return "[" + ", ".join(parts) + "]"


def _difference(got, expected, args=()) -> str:
    """Where two list-like answers first differ, as ' (...)', or ''. Arguments as long as the
    answer are shown at that index too (the entries that decide it)."""
    a, b = _seq(got), _seq(expected)
    if a is None or b is None:
        return ""
    if len(a) != len(b):
        return f" (length {len(a)}, expected length {len(b)})"
    for i, (x, y) in enumerate(zip(a, b)):
        if not _close(x, y):
            at = [_seq(a) for a in args]
            inputs = [_summary(a[i], 60) for a in at if a is not None and len(a) == len(b)]
            where = f"; the arguments there: {', '.join(inputs)}" if inputs and len(b) > 2 * _SHOW else ""
            return f" (first difference at [{i}]: got {_summary(x, 60)}, expected {_summary(y, 60)}{where})"
    return ""


def _copy(args: tuple) -> tuple:
    try:
        return copy.deepcopy(args)
    except Exception:  # something that cannot be copied is passed as is
        return args


def fmt_args(args) -> str:
    """A call's arguments as ``(a, b, ...)``, each summarised like the verdict lines do."""
    return "(" + ", ".join(_summary(a) for a in args) + ")"


def summary(value, width: int = 120) -> str:
    """``repr(value)``, or for a long list/tensor its length or shape with its first and last values."""
    return _summary(value, width)


_fmt_args = fmt_args  # the name lesson checkers imported first


def say(line: str) -> None:
    """Print a checker's verdict or hint, wrapped to 100 columns (the lines after the first indented)."""
    print(wrapped(str(line), indent=3))


def not_implemented(name: str) -> bool:
    """Print the ⏳ verdict of a stub; False."""
    say(f"⏳ {name} is not implemented yet: write it above, then re-run this cell.")
    return False


def _failed(name: str, line: str, hint: str | None) -> bool:
    say(line)
    _FAILURES[name] = _FAILURES.get(name, 0) + 1
    if hint and _FAILURES[name] >= 2:
        say(f"💡 Hint: {hint}")
    return False


def run_cases(fn, name: str, cases, reference, *, compare=_close, hint: str | None = None,
              signature: str | None = None, seconds: float | None = None) -> bool:
    """Check ``compare(fn(*args), reference(*args))`` for every ``args`` in ``cases``.

    Prints one verdict line (⏳ / ❌ / ✅) and returns True or False. ``hint`` (a sentence) is
    printed after the verdict from the second failure of the checker ``name`` on. Each call of
    ``fn`` gets its own copy of the arguments, so a learner's function that changes its input
    changes neither the next case nor the arguments shown. Each call runs inside
    :func:`learner_call` (``seconds``: its time limit). ``signature`` (such as
    ``"(nbytes, ms) -> float"``) names ``fn`` in the TypeError when it is not a function.
    """
    if signature is not None:
        learner_arg(name, fn, signature)
    learner_arg("fn", fn, "taking the arguments of each case")
    text_arg("name", name)
    learner_arg("reference", reference, "taking the arguments of each case")
    learner_arg("compare", compare, "(got, expected) -> bool")
    if hint is not None:
        text_arg("hint", hint)
    n = 0
    for i, args in enumerate(cases):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"cases[{i}] must be a tuple of arguments, got {type(args).__name__}")
        args = tuple(args)
        expected = reference(*_copy(args))
        try:
            with learner_call(f"{name}{fmt_args(args)}", seconds):
                got = fn(*_copy(args))
        except LearnerStop as stop:
            return _failed(name, f"❌ {name}: {stop}", hint)
        except Exception as exc:  # the learner's bug, reported, not raised
            if is_stub(exc, fn):
                return not_implemented(name)
            return _failed(name, f"❌ {name}{fmt_args(args)} raised {raised(exc)}", hint)
        try:
            ok = bool(compare(got, expected))  # the checker's own compare: it judges by type first
        except Exception:  # an answer of a shape compare cannot handle is a wrong answer
            ok = False
        if not ok:
            return _failed(
                name,
                f"❌ {name}{fmt_args(args)} returned {_summary(got)}, expected {_summary(expected)}"
                f"{_difference(got, expected, args)}",
                hint,
            )
        n += 1
    _FAILURES.pop(name, None)
    say(f"✅ {name} is correct ({n} cases).")
    return True
