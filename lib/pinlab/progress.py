"""A progress bar for long sweeps (tqdm on stderr, which the notebook tests do not compare)."""
from __future__ import annotations

import sys

from tqdm import tqdm

from .args import positive_int, text_arg


def progress(iterable, desc: str, total: int | None = None):
    """Wrap ``iterable`` in a text progress bar written to stderr.

    ``desc`` is a short str; ``total`` (an int >= 0) is needed only where ``iterable`` has no len().
    """
    if isinstance(iterable, (str, bytes)) or not hasattr(iterable, "__iter__"):
        raise TypeError(f"iterable must be a list, range or other iterable, got {type(iterable).__name__}")
    text_arg("desc", desc, allow_empty=True)
    if total is not None:
        total = positive_int("total", total, allow_zero=True)
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=True, dynamic_ncols=True,
                mininterval=0.5)
