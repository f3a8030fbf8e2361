"""Exercise checkers: each runs the learner's function on cases and compares with a reference.

A checker prints one verdict line and returns nothing (so that a checker ending a cell shows no
``Out: True``); ``check_x.verdict(...)`` runs the same check and returns True or False (tests, scripts,
a claim built on it). Every public ``check_*`` of ``checks/lNN.py`` is wrapped by :func:`checker`:

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

The core is three small modules, re-exported here: :mod:`.guard` (the learner's call), :mod:`.compare`
(type-first comparisons and the summaries of answers) and :mod:`.verdict` (the printed verdict, hints,
:func:`checker`).
"""
from __future__ import annotations

from .compare import (_SHOW, _close, _copy, _difference, _ends, _fmt_args, _is_array, _number, _numel, _plain,  # noqa: F401
                      _repr, _seq, _summary, as_int, fmt_args, int_list, same_int, same_tensor, summary)
from .guard import (TIMEOUT_ENV, TIMEOUT_S, LearnerStop, _codes, _innermost_outside_library, _raise_site,  # noqa: F401
                    _TorchState, _timeout_text, _Timer, is_stub, learner_arg, learner_call, raised, timeout_s)
from .verdict import _FAILURES, _failed, checker, not_implemented, run_cases, say  # noqa: F401
