"""Claims that explain themselves: what a notebook asserts, and what it only observes.

Two kinds of statement, one helper each:

* :func:`claim` - a fact that holds on **any CUDA GPU, quiet or shared**: an exact result (0 corrupted
  steps, the same storage, bitwise equality, a count), or a race shown with a wide GPU lead. It prints
  ``<text>: True`` (a compared line under nbval) and, where it does not hold, raises
  :class:`ClaimError` with the claim, this run's value, the lesson's reason why it may not hold, and
  what this machine is (GPU, link, other processes on the GPU, CPU cores): never a bare
  ``AssertionError``.
* :func:`observe` - what depends on the link, the driver's staging or the host's speed. It prints a
  ``[measured]`` line (masked under nbval) saying whether it held **in this run**, with the value, and
  where it did not, why a machine may differ. It never fails.

One line per fact: its text, its value, its threshold and a reason. The reasons ("why it may not hold
on this machine") live in a :class:`Reasons` table in the lesson module, so that the notebook keeps the
fact and the lesson module keeps the excuse::

    WHY = pinlab.Reasons(torch_bug="the allocator keeps each snapshot until its copy has run: a corrupted "
                                   "step is a bug in torch")                      # in lessons/l04_*.py
    pinlab.claim("corrupted steps with the snapshot", corrupted, expect=0, why=l04.WHY.torch_bug)
    pinlab.observe("pinned H2D at least 2x pageable at 1 GiB", ratio >= 2, value=f"{ratio:.1f}x",
                   why=l01.WHY.link)
"""
from __future__ import annotations

import math
import numbers

from .timing import show, wrapped

__all__ = ["ClaimError", "Reasons", "claim", "claims", "observe"]

_UNSET = object()


class ClaimError(AssertionError):
    """A claim a lesson asserts did not hold in this run; the message says which, with what value, and why
    this machine may differ."""


class Reasons(dict):
    """A lesson's table of reasons why a fact may not hold on some machine: ``WHY.torch_bug`` is the
    sentence stored under ``torch_bug``. Every reason is a non-empty str; an unknown name is an error that
    lists the names the table has (a typo in a notebook never passes as "no reason")."""

    def __init__(self, **reasons: str):
        if not reasons:
            raise TypeError("Reasons needs at least one name=sentence")
        for name, text in reasons.items():
            _text(f"reason {name!r}", text)
        super().__init__(reasons)

    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no reason {name!r} in this table; it has: {', '.join(sorted(self))}") from None


def _text(name: str, text) -> str:
    if not isinstance(text, str) or not text.strip():
        raise TypeError(f"{name} must be a non-empty str (the claim in words), got {type(text).__name__}")
    return text.strip()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _truth(name: str, holds) -> bool:
    """``holds`` as a bool: a bool, or one bool in a numpy/torch container (``torch.equal``, ``(a == b).all()``).
    A count, a float or None is refused: ``bool(3)`` and ``bool(nan)`` are True, a silently wrong claim."""
    if isinstance(holds, bool):
        return holds
    dtype = str(getattr(holds, "dtype", ""))
    if dtype in ("bool", "torch.bool"):
        numel = getattr(holds, "numel", None)
        size = numel() if callable(numel) else getattr(holds, "size", None)
        if size == 1:
            return bool(holds)
        raise TypeError(f"{name} must be one bool (whether the claim held), got {size} of them in a "
                        f"{type(holds).__name__}: reduce it with .all() or .any()")
    raise TypeError(f"{name} must be a bool (whether the claim held), got {type(holds).__name__} ({_short(holds)}); "
                    "compare it (`count == 0`), or for an exact count use pinlab.claims({text: count}, "
                    "expect={text: 0})")


def _count(name: str, value):
    """A count a claim compares with its exact expected value: an int (or a whole number), never NaN."""
    if not isinstance(value, numbers.Number) and callable(getattr(value, "item", None)):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", None)
        if size != 1:
            raise TypeError(f"{name} must be one number (a count), got {size} of them in a {type(value).__name__}")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (a count compared with expect), got {type(value).__name__} "
                        f"({_short(value)})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite count, got {value}")
    return value


def _why(why) -> str:
    if why is None:
        return ""
    return _text("why", why)


def failure_message(text: str, value=None, why: str | None = None) -> str:
    """The message of a failed claim: the claim, this run's value, why it may not hold, and this machine."""
    from .probe import LAUNCH_BLOCKING_WHY, launch_blocking, machine_summary

    text, why = _text("text", text), (_why(why) if why not in (None, "") else "")
    parts = [f"Claim did not hold in this run: {text}."]
    if value is not None:
        parts.append(f"This run's value: {value}.")
    if launch_blocking():
        parts.append(f"The likely cause: {LAUNCH_BLOCKING_WHY}.")
        if why:
            parts.append(f"Other reasons it may not hold: {why.rstrip('.')}.")
    elif why:
        parts.append(f"Why it may not hold here: {why.rstrip('.')}.")
    parts.append(f"This machine: {machine_summary()}.")
    return " ".join(parts)


def claim(text: str, holds, *, expect=_UNSET, value=None, why: str | None = None, shown=True) -> None:
    """Assert a fact that holds on any CUDA GPU, quiet or shared, in one line; print ``text: True``.

    ``holds``: whether it held, or with ``expect`` a count that must equal ``expect`` exactly (then the
    line reads ``text: <count>``); ``value``: what this run measured (shown in the failure message);
    ``why``: what may make it fail on some machine (a shared GPU, the link, the OS), usually a name of
    the lesson's :class:`Reasons` table. ``shown=False`` prints nothing (for a claim the cell already
    printed). Raises :class:`ClaimError` with all of that, never a bare ``AssertionError``. Returns
    nothing, so that a claim ending a cell prints its one line and no ``Out: True``.
    """
    text = _text("text", text)
    if expect is _UNSET:
        ok, line = _truth("holds", holds), None
    else:
        count = _count("holds (a count, since expect is given)", holds)
        ok = count == _count("expect", expect)
        line = count
        value = f"{holds if value is None else value} (expected exactly {expect})"
    why = _why(why)
    if not isinstance(shown, bool):
        raise TypeError(f"shown must be True or False, got {type(shown).__name__} ({_short(shown)})")
    if shown:
        print(wrapped(f"{text}: {ok if line is None else line}"))
    if not ok:
        raise ClaimError(failure_message(text, value, why))


def claims(mapping: dict, *, why=None, values: dict | None = None, expect=None) -> None:
    """Print ``claim: value`` for every entry of ``mapping`` (claim text -> bool, or a count with
    ``expect``), then fail, like :func:`claim`, on the first that does not hold (every entry is judged).

    ``why``: one sentence for all, or a dict claim text -> sentence; ``values``: claim text -> the value
    behind it (for the message); ``expect``: claim text -> the exact value a count must have (e.g. 0).
    Every argument is checked before anything is printed. Returns nothing, as :func:`claim`.
    """
    if not isinstance(mapping, dict) or not mapping:
        raise TypeError("mapping must be a non-empty dict of claim text -> whether it held, got "
                        f"{type(mapping).__name__} ({_short(mapping)})")
    texts = {_text("each key of mapping (a claim in words)", k): k for k in mapping}
    if len(texts) != len(mapping):
        raise ValueError("mapping names a claim twice (two keys equal once stripped of spaces)")
    if why is not None and not isinstance(why, (str, dict)):
        raise TypeError(f"why must be a str or a dict of claim text -> str, got {type(why).__name__}")
    values = {} if values is None else values
    expect = {} if expect is None else expect
    for name, arg in (("values", values), ("expect", expect)) + ((("why", why),) if isinstance(why, dict) else ()):
        if not isinstance(arg, dict):
            raise TypeError(f"{name} must be a dict keyed by claim text, got {type(arg).__name__}")
        unknown = [k for k in arg if k not in mapping]
        if unknown:
            raise ValueError(f"{name} names claims that are not in mapping: {unknown[:3]} (use mapping's keys)")
    reasons = {k: _why(why.get(k) if isinstance(why, dict) else why) for k in mapping}
    verdicts = {}
    for key, value in mapping.items():
        if key in expect:
            want = _count(f"expect[{key!r}]", expect[key])
            verdicts[key] = _count(f"mapping[{key!r}]", value) == want
        else:
            verdicts[key] = _truth(f"mapping[{key!r}]", value)
    for key, value in mapping.items():
        print(wrapped(f"{key.strip()}: {value}"))
    for key, value in mapping.items():
        if not verdicts[key]:
            shown = values.get(key, value)
            if key in expect:
                shown = f"{shown} (expected exactly {expect[key]})"
            raise ClaimError(failure_message(key.strip(), shown, reasons[key]))


def observe(text: str, holds, *, value=None, why: str | None = None) -> bool:
    """Print whether a machine-dependent expectation held in this run, as a ``[measured]`` line; never fail.

    ``text: yes (value)``, or ``text: not in this run (value); why``. Returns whether it held, so that
    the sentence beside it can be computed from this run.
    """
    text = _text("text", text)
    ok = _truth("holds", holds)
    why = _why(why)
    shown = f" ({value})" if value is not None else ""
    if ok:
        show(text, f"yes{shown}")
    else:
        from .probe import LAUNCH_BLOCKING_WHY, launch_blocking

        why = LAUNCH_BLOCKING_WHY if launch_blocking() else why
        show(text, f"not in this run{shown}" + (f"; {why.rstrip('.')}" if why else ""))
    return ok
