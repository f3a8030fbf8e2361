"""The verdict: one line (⏳ / ❌ / ✅) per checker call, a hint from the second failure on, and
:func:`checker`, which makes a lesson checker return nothing in a notebook and its bool through
``.verdict``. Part of the checkers' core (:mod:`pinlab.checks`), with :mod:`.guard` and :mod:`.compare`.
"""
from __future__ import annotations

import functools
import inspect

from ..args import text_arg
from ..timing import wrapped
from .compare import _close, _copy, _difference, _summary, fmt_args
from .guard import LearnerStop, is_stub, learner_arg, learner_call, raised

#: Failures so far per checker name (reset when it passes): the hint shows from the second on.
_FAILURES: dict[str, int] = {}



def say(line: str) -> None:
    """Print a checker's verdict or hint, wrapped to 100 columns (the lines after the first indented)."""
    print(wrapped(str(line), indent=3))


def checker(verdict):
    """Wrap a lesson checker ``verdict(...) -> bool``: the wrapped ``check(...)`` prints the same verdict and
    returns None (a notebook's cell ends with it and shows no ``Out: True``, and needs no ``ok =`` line);
    ``check.verdict(...)`` is the bool-returning check itself."""
    @functools.wraps(verdict)
    def check(*args, **kwargs) -> None:
        verdict(*args, **kwargs)

    check.verdict = verdict
    check.__signature__ = inspect.signature(verdict).replace(return_annotation="None")
    check.__doc__ = (verdict.__doc__ or "").rstrip() + "\n\nPrints the verdict; ``.verdict(...)`` returns it as a bool."
    return check


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
