"""PyTorch's caching host allocator: statistics, releasing cached blocks, allocation rounding."""
from __future__ import annotations

import numbers

import torch


def host_stats() -> dict:
    """``torch.cuda.host_memory_stats()`` as a plain dict ({} where this torch lacks it or has no CUDA)."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return {}
    return {k: v for k, v in fn().items()}


def release_cached_host_blocks() -> bool:
    """Give cached, unused pinned blocks back to the driver. True where this torch can."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.synchronize()
    for name in ("empty_host_cache",):
        fn = getattr(torch.cuda, name, None)
        if fn is not None:
            fn()
            return True
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()
        return True
    return False


def pinned_bytes_held() -> int:
    """Bytes of page-locked memory the caching host allocator holds now (in use or cached)."""
    return int(host_stats().get("allocated_bytes.current", 0))


def next_pow2(n: int) -> int:
    """The block size PyTorch's caching host allocator rounds a request of ``n`` bytes up to."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int (bytes), got {type(n).__name__} ({n!r})"[:160])
    if n <= 0:
        raise ValueError(f"n must be a positive int (bytes), got {n!r}")
    return 1 << (int(n) - 1).bit_length()


def pinned_baseline() -> int:
    """Release cached pinned blocks and return the bytes still held: call at a notebook's start."""
    release_cached_host_blocks()
    return pinned_bytes_held()


#: why "pinned memory held is back to its starting level" may not hold, the reason of every lesson's last claim
PINNED_BACK_WHY = ("every experiment frees what it pinned and empties torch's pinned cache; a tensor still referenced "
                   "from a cell, an error that stopped an experiment halfway, or another thread or library of this "
                   "process that pinned memory meanwhile keeps a block")


def pinned_back_to(baseline: int) -> bool:
    """Release cached pinned blocks; True when the bytes held are back to ``baseline``.

    ``baseline`` is what :func:`pinned_baseline` returned (an int >= 0); anything else is a
    TypeError/ValueError, never False (False means "pinned memory is still held").
    """
    if isinstance(baseline, bool) or not isinstance(baseline, numbers.Integral):
        raise TypeError(f"baseline must be the int that pinned_baseline() returned, "
                        f"got {type(baseline).__name__} ({baseline!r})"[:200])
    if baseline < 0:
        raise ValueError(f"baseline must be >= 0 (bytes), got {baseline}")
    release_cached_host_blocks()
    return pinned_bytes_held() == baseline
