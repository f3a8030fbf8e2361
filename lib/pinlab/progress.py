"""A progress bar for long sweeps (tqdm on stderr, which the notebook tests do not compare)."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress(iterable, desc: str, total: int | None = None):
    """Wrap ``iterable`` in a text progress bar written to stderr."""
    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=True, dynamic_ncols=True,
                mininterval=0.5)
