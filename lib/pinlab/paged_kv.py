"""Paged KV-cache metadata for FlashInfer decode, as vLLM builds it, plus a torch reference.

A paged KV cache stores each request's keys and values in fixed-size pages. FlashInfer's
decode kernel finds a request's pages through three int32 arrays (CSR form, "NHD" layout):

* ``indptr`` [B+1]: 0, then the running sum of the pages per request;
* ``indices`` [indptr[-1]]: the page ids of request 0, then request 1, and so on;
* ``last_page_len`` [B]: how many tokens the last page holds (0 only for an empty sequence).

vLLM computes ``indptr`` and ``last_page_len`` on the host, copies them to the GPU, and builds
``indices`` on the GPU from that GPU copy of ``indptr`` and the block table. That host->device
copy of ``indptr`` is what the lessons study. The formulas here are vLLM's
(``vllm/v1/attention/backends/flashinfer.py``, ``_compute_flashinfer_kv_metadata``).

Worked example (page_size 16): seq_lens [37, 48, 17, 0] give pages [3, 3, 2, 0],
indptr [0, 3, 6, 8, 8] and last_page_len [5, 16, 1, 0].

FlashInfer itself is imported only inside :class:`FlashInferDecode`, never at import time.

Why about 600 lines in one module: it is one take-home tool (metadata, the reference that
checks it, the FlashInfer glue that consumes it, and the random batches its tests use), and a
third of it is argument checking (int32 overflow, page ids, indptr shape) that every part shares.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .args import INT32_MAX, positive_int, positive_number
from .device import require_cuda

__all__ = [
    "PagedKVMetadata",
    "RandomBatch",
    "FlashInferUnavailableError",
    "FlashInferDecode",
    "num_pages",
    "kv_indptr",
    "last_page_len",
    "page_indices",
    "build_metadata",
    "reference_decode",
    "flashinfer_available",
    "random_batch",
]

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_KV_DTYPES = (torch.float16, torch.bfloat16)
_INT64_MAX = 2**63 - 1
#: random_batch refuses to allocate caches larger than this many elements each.
MAX_RANDOM_ELEMENTS = 2**28


# --------------------------------------------------------------------------- argument checks

def _int_tensor(name: str, value, *, ndim: int, dtypes=_INT_DTYPES) -> torch.Tensor:
    """``value`` as an integer tensor with ``ndim`` dims, or a clear TypeError/ValueError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in dtypes:
        wanted = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(
            f"{name} must have an integer dtype ({wanted}), got {value.dtype}; "
            f"convert it with .to(torch.int32)"
        )
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def _seq_lens(name: str, seq_lens) -> torch.Tensor:
    """A 1-D integer tensor of sequence lengths. Lists and tuples of ints become CPU tensors.

    Negative lengths are rejected for CPU tensors only: checking a GPU tensor would need a
    host sync, which this module never adds.
    """
    if isinstance(seq_lens, (list, tuple)):
        for i, v in enumerate(seq_lens):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} ({v!r})"[:200])
            if v < 0:
                raise ValueError(f"{name} must be >= 0 everywhere, got {name}[{i}] = {v}")
            if v > _INT64_MAX:
                raise ValueError(f"{name}[{i}] = {v} does not fit in int64")
        seq_lens = torch.tensor([int(v) for v in seq_lens], dtype=torch.int64)
    t = _int_tensor(name, seq_lens, ndim=1)
    if t.device.type == "cpu" and t.numel() and bool((t < 0).any()):
        bad = int(torch.nonzero(t < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0 everywhere, got {name}[{bad}] = {int(t[bad])}")
    return t


def _same_device(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.device != other.device:
        raise ValueError(
            f"{name} is on {t.device} but {other_name} is on {other.device}; "
            f"copy {name} to {other.device} first"
        )


# --------------------------------------------------------------------------- metadata

def _page_size(page_size) -> int:
    # FlashInfer takes page_size as an int32, and last_page_len (<= page_size) is int32.
    return positive_int("page_size", page_size, maximum=INT32_MAX)


def _num_pages64(seq_lens, page_size: int, name: str = "seq_lens") -> torch.Tensor:
    """ceil(seq_len / page_size) in int64, without overflow for any int64 length."""
    s = _seq_lens(name, seq_lens).to(torch.int64)
    pages = torch.div(s, page_size, rounding_mode="floor") + (torch.remainder(s, page_size) != 0).to(torch.int64)
    if pages.device.type == "cpu" and pages.numel() and int(pages.max()) > INT32_MAX:
        bad = int(torch.argmax(pages))
        raise ValueError(
            f"{name}[{bad}] = {int(s[bad])} needs {int(pages[bad])} pages of page_size {page_size}, more than "
            f"FlashInfer's int32 metadata holds ({INT32_MAX}); use shorter sequences or larger pages"
        )
    return pages


def num_pages(seq_lens, page_size: int) -> torch.Tensor:
    """Pages per request: ceil(seq_len / page_size), int32, on the device of ``seq_lens``.

    A count that does not fit in int32 is a ValueError for CPU input (GPU input is not checked:
    that would need a host sync, which this module never adds).
    """
    page_size = _page_size(page_size)
    return _num_pages64(seq_lens, page_size).to(torch.int32)


def kv_indptr(seq_lens, page_size: int) -> torch.Tensor:
    """int32 [B+1]: 0, then the running sum of :func:`num_pages`. Same device as ``seq_lens``.

    The sum is taken in int64; for CPU input a total that does not fit in int32 is a ValueError.
    """
    return _kv_indptr(seq_lens, _page_size(page_size), "seq_lens")


def _kv_indptr(seq_lens, page_size: int, name: str) -> torch.Tensor:
    pages = _num_pages64(seq_lens, page_size, name)
    out = torch.zeros(pages.numel() + 1, dtype=torch.int64, device=pages.device)
    torch.cumsum(pages, dim=0, out=out[1:])
    if out.device.type == "cpu" and int(out[-1]) > INT32_MAX:
        raise ValueError(
            f"{name} need {int(out[-1])} pages in all, more than FlashInfer's int32 indptr holds "
            f"({INT32_MAX}); split the batch"
        )
    return out.to(torch.int32)


def last_page_len(seq_lens, page_size: int) -> torch.Tensor:
    """int32 [B]: tokens in each request's last page.

    That is seq_len % page_size, or page_size when the page is full, and 0 for an empty
    sequence (vLLM's formula; FlashInfer's ``get_seq_lens`` inverts it).
    """
    page_size = _page_size(page_size)
    s = _seq_lens("seq_lens", seq_lens).to(torch.int64)
    r = torch.remainder(s, page_size)
    full = (r == 0) & (s != 0)
    return torch.where(full, torch.full_like(r, page_size), r).to(torch.int32)


def page_indices(block_table: torch.Tensor, indptr: torch.Tensor, total_pages: int) -> torch.Tensor:
    """Each request's first num_pages entries of its block-table row, concatenated (int32).

    ``block_table`` is [B, max_pages_per_request]; ``indptr`` is the int32 [B+1] from
    :func:`kv_indptr`, on the block table's device; ``total_pages`` is ``indptr[-1]`` as a
    Python int, which the caller knows from its host copy of indptr (as vLLM does).

    Everything runs on the block table's device with no host sync and no Python loop over
    requests: request ids come from ``repeat_interleave(..., output_size=total_pages)``, and
    each page's position in its row is its flat position minus ``indptr[request]``.
    (vLLM does the same with a Triton kernel.) A wrong ``total_pages`` gives an error or a
    wrong result; it is checked against ``indptr`` only when ``indptr`` is on the CPU.

    On the CPU (free: no device to wait for) ``indptr`` must start at 0 and never decrease,
    and the page ids used must be >= 0 and fit in int32; on a GPU nothing is read back.
    """
    block_table = _int_tensor("block_table", block_table, ndim=2)
    indptr = _int_tensor("indptr", indptr, ndim=1, dtypes=(torch.int32,))
    total_pages = positive_int("total_pages", total_pages, allow_zero=True, maximum=INT32_MAX)
    batch = block_table.shape[0]
    if indptr.numel() != batch + 1:
        raise ValueError(
            f"indptr must have batch_size + 1 = {batch + 1} entries (block_table has {batch} rows), "
            f"got {indptr.numel()}"
        )
    _same_device("indptr", indptr, "block_table", block_table)
    if indptr.device.type == "cpu":  # free to check here: no device to wait for
        if int(indptr[0]) != 0:
            raise ValueError(f"indptr must start at 0, got indptr[0] = {int(indptr[0])}")
        steps = indptr[1:] - indptr[:-1]
        if steps.numel() and bool((steps < 0).any()):
            bad = int(torch.nonzero(steps < 0)[0, 0])
            raise ValueError(
                f"indptr must never decrease, got indptr[{bad}] = {int(indptr[bad])} > "
                f"indptr[{bad + 1}] = {int(indptr[bad + 1])}"
            )
        if int(indptr[-1]) != total_pages:
            raise ValueError(f"total_pages must equal indptr[-1] = {int(indptr[-1])}, got {total_pages}")
        widest = int((indptr[1:] - indptr[:-1]).max()) if batch else 0
        if widest > block_table.shape[1]:
            raise ValueError(
                f"a request needs {widest} pages but block_table has only {block_table.shape[1]} columns"
            )
    device = block_table.device
    counts = (indptr[1:] - indptr[:-1]).to(torch.int64)
    request = torch.repeat_interleave(
        torch.arange(batch, device=device), counts, output_size=total_pages
    )
    position = torch.arange(total_pages, device=device) - indptr.to(torch.int64)[request]
    pages = block_table[request, position]
    if pages.device.type == "cpu" and pages.numel():
        bad = torch.nonzero((pages < 0) | (pages.to(torch.int64) > INT32_MAX))
        if bad.numel():
            k = int(bad[0, 0])
            row, col = int(request[k]), int(position[k])
            raise ValueError(
                f"block_table[{row}, {col}] = {int(pages[k])} is not a page id: the pages a request uses "
                f"must be in 0..{INT32_MAX}"
            )
    return pages.to(torch.int32)


class PagedKVMetadata(NamedTuple):
    """What FlashInfer's decode ``plan()`` needs: host indptr and last_page_len, device indices."""

    indptr_cpu: torch.Tensor
    """int32 [B+1] on the CPU."""
    last_page_len_cpu: torch.Tensor
    """int32 [B] on the CPU."""
    indices: torch.Tensor
    """int32 [indptr[-1]] on the device."""

    @property
    def batch_size(self) -> int:
        return self.last_page_len_cpu.numel()

    @property
    def total_pages(self) -> int:
        return int(self.indptr_cpu[-1])


def build_metadata(block_table: torch.Tensor, seq_lens_cpu, page_size: int, device=None) -> PagedKVMetadata:
    """All three arrays at once, the way vLLM splits the work between host and device.

    ``indptr`` and ``last_page_len`` are computed on the CPU from ``seq_lens_cpu`` (these are
    what travel host->device in the lessons). ``indices`` is built on ``device`` (default: the
    block table's device) by :func:`page_indices` from a device copy of indptr.

    The copies made here are plain ``.to(device)`` calls (indptr, and the block table if it is
    elsewhere): simple and correct, not fast. The lessons copy indptr themselves, through
    pinned or pageable buffers, and then call :func:`page_indices`.
    """
    block_table = _int_tensor("block_table", block_table, ndim=2)
    seq_lens_cpu = _seq_lens("seq_lens_cpu", seq_lens_cpu)
    if seq_lens_cpu.device.type != "cpu":
        raise ValueError(
            f"seq_lens_cpu must be a CPU tensor (vLLM keeps a host copy), got one on {seq_lens_cpu.device}; "
            "pass seq_lens.cpu()"
        )
    page_size = _page_size(page_size)
    device = _metadata_device(device, block_table)
    if seq_lens_cpu.numel() != block_table.shape[0]:
        raise ValueError(
            f"seq_lens_cpu has {seq_lens_cpu.numel()} requests but block_table has "
            f"{block_table.shape[0]} rows; they must match"
        )
    pages = _num_pages64(seq_lens_cpu, page_size, "seq_lens_cpu")
    widest = int(pages.max()) if pages.numel() else 0
    if widest > block_table.shape[1]:
        raise ValueError(
            f"a sequence needs {widest} pages of {page_size} tokens but block_table has only "
            f"{block_table.shape[1]} columns; make the block table wider or the sequences shorter"
        )
    indptr_cpu = _kv_indptr(seq_lens_cpu, page_size, "seq_lens_cpu")
    lpl_cpu = last_page_len(seq_lens_cpu, page_size)
    indices = page_indices(block_table.to(device), indptr_cpu.to(device), int(indptr_cpu[-1]))
    return PagedKVMetadata(indptr_cpu, lpl_cpu, indices)


def _metadata_device(device, block_table: torch.Tensor) -> torch.device:
    """``device`` (None: the block table's) as a torch.device; a CUDA one only where CUDA runs."""
    if device is None:
        return block_table.device
    return _device_arg(device, "build_metadata")


def _device_arg(device, what: str) -> torch.device:
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be None, a str such as 'cuda' or 'cpu', or a torch.device, "
                        f"got {type(device).__name__} ({device!r})"[:200])
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device must name a device such as 'cuda' or 'cpu', got {device!r}") from exc
    if dev.type == "cuda":
        require_cuda(f"{what}(device={str(dev)!r})")
    return dev


# --------------------------------------------------------------------------- reference attention

def reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Paged decode attention in plain torch, in fp32: the answer FlashInfer should give.

    ``q`` is [B, num_qo_heads, head_dim]; ``k_cache``/``v_cache`` are
    [num_pages_total, page_size, num_kv_heads, head_dim] (NHD). With grouped-query attention
    query head h reads kv head h // (num_qo_heads // num_kv_heads). ``sm_scale`` defaults to
    1/sqrt(head_dim). Returns fp32 [B, num_qo_heads, head_dim] on q's device; an empty
    sequence gives zeros. It loops over requests and reads the metadata on the host (a sync
    when it lives on the GPU): it is a reference, not a fast path.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (no data); give a CPU or CUDA tensor")
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_pages, page_size, num_kv_heads, head_dim] (NHD), got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    batch, num_qo_heads, head_dim = q.shape
    total_pool, page_size, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k_cache has head_dim {kv_head_dim}; they must match")
    if head_dim == 0:
        raise ValueError(f"q and k_cache must have head_dim > 0, got shapes {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if page_size == 0:
        raise ValueError(f"k_cache must have page_size > 0 (its dim 1), got shape {tuple(k_cache.shape)}")
    if num_kv_heads == 0:
        raise ValueError(
            f"k_cache must have num_kv_heads > 0 (its dim 2), got shape {tuple(k_cache.shape)}"
        )
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    indptr = _int_tensor("indptr", indptr, ndim=1, dtypes=(torch.int32,)).cpu().to(torch.int64)
    indices = _int_tensor("indices", indices, ndim=1, dtypes=(torch.int32,)).cpu().to(torch.int64)
    lpl = _int_tensor("last_page_len", last_page_len, ndim=1, dtypes=(torch.int32,)).cpu().to(torch.int64)
    if indptr.numel() != batch + 1:
        raise ValueError(f"indptr must have batch_size + 1 = {batch + 1} entries (q has {batch} rows), got {indptr.numel()}")
    if lpl.numel() != batch:
        raise ValueError(f"last_page_len must have batch_size = {batch} entries (q has {batch} rows), got {lpl.numel()}")
    if int(indptr[0]) != 0 or bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"indptr must start at 0 and never decrease, got {indptr.tolist()}")
    if indices.numel() < int(indptr[-1]):
        raise ValueError(f"indices must hold at least indptr[-1] = {int(indptr[-1])} page ids, got {indices.numel()}")
    used = indices[: int(indptr[-1])]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= total_pool):
        raise ValueError(f"indices must be page ids in [0, {total_pool}), got values from {int(used.min())} to {int(used.max())}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    sm_scale = positive_number("sm_scale", sm_scale)

    group = num_qo_heads // num_kv_heads
    out = torch.zeros(batch, num_qo_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        start, end = int(indptr[b]), int(indptr[b + 1])
        n, tail = end - start, int(lpl[b])
        if n == 0:
            if tail != 0:
                raise ValueError(f"last_page_len[{b}] must be 0 for a request with no pages, got {tail}")
            continue
        if not 1 <= tail <= page_size:
            raise ValueError(f"last_page_len[{b}] must be in 1..{page_size} for a request with pages, got {tail}")
        kv_len = (n - 1) * page_size + tail
        pages = indices[start:end].to(k_cache.device)
        k = k_cache[pages].reshape(n * page_size, num_kv_heads, head_dim)[:kv_len].float()
        v = v_cache[pages].reshape(n * page_size, num_kv_heads, head_dim)[:kv_len].float()
        k = k.repeat_interleave(group, dim=1).to(q.device)  # [kv_len, num_qo_heads, head_dim]
        v = v.repeat_interleave(group, dim=1).to(q.device)
        logits = torch.einsum("hd,thd->ht", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), v)
    return out


# --------------------------------------------------------------------------- FlashInfer glue

class FlashInferUnavailableError(RuntimeError):
    """FlashInfer cannot run here: no CUDA, not installed, or its kernels failed to build."""


def flashinfer_available() -> tuple[bool, str]:
    """(True, note) when FlashInfer can be tried here (CUDA and an importable flashinfer),
    else (False, a one-sentence reason). Never raises."""
    try:
        from .device import flashinfer_status, has_cuda

        if not has_cuda():
            return False, "FlashInfer needs a CUDA GPU, and none is available here."
        version, note = flashinfer_status()
        if version is None:
            return False, note.rstrip(".") + "."
        return True, f"{note}, and a CUDA GPU is available."
    except Exception as exc:  # pragma: no cover - defensive: this function must not raise
        return False, f"Could not check for FlashInfer ({type(exc).__name__}: {str(exc)[:120]})."


class FlashInferDecode:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (NHD layout) with the shapes fixed.

    Call :meth:`plan` once per step with the metadata (host ``indptr``/``last_page_len``,
    device ``indices``), then :meth:`run`. Given **pinned** host ``indptr`` and ``last_page_len``
    (as vLLM 0.33 passes them), ``plan()`` makes no pageable copy at all (see :meth:`plan`). Construction raises
    :class:`FlashInferUnavailableError` when FlashInfer cannot run here. The first ``plan``
    and ``run`` compile kernels (JIT, seconds): an error there is re-raised as
    :class:`FlashInferUnavailableError`, with the original as ``__cause__``.
    Works with flashinfer-python 0.6.18 and 0.7.x (options are passed by keyword).
    :func:`reference_decode` gives zeros for an empty request; FlashInfer's output for one is
    not specified, so compare non-empty requests only.

    With ``graph_batch`` and ``graph_max_pages`` the wrapper is FlashInfer's CUDA-graph mode
    (``use_cuda_graph=True`` with fixed device buffers for indptr, indices and last_page_len, as vLLM
    builds one per batch size): ``plan()`` stays outside the graph and copies the step's metadata into
    those buffers; ``run()`` may be captured once and replayed (lesson 08).
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype = torch.float16,
        workspace_bytes: int = 128 * 1024 * 1024,
        *,
        use_tensor_cores: bool = False,
        graph_batch: int | None = None,
        graph_max_pages: int | None = None,
    ) -> None:
        self.num_qo_heads = positive_int("num_qo_heads", num_qo_heads)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.page_size = positive_int("page_size", page_size)
        workspace_bytes = positive_int("workspace_bytes", workspace_bytes)
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if dtype not in _KV_DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        if (graph_batch is None) != (graph_max_pages is None):
            raise ValueError("graph_batch and graph_max_pages go together: pass both (a wrapper for CUDA graphs, "
                             "with fixed device buffers) or neither")
        self.graph_batch = None if graph_batch is None else positive_int("graph_batch", graph_batch)
        graph_max_pages = None if graph_max_pages is None else positive_int("graph_max_pages", graph_max_pages)
        ok, reason = flashinfer_available()
        if not ok:
            raise FlashInferUnavailableError(reason)
        try:
            import flashinfer

            self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device="cuda")
            graph = {}
            if self.graph_batch is not None:  # use_cuda_graph: plan() copies into these fixed device buffers
                self.buffers = {
                    "paged_kv_indptr_buffer": torch.zeros(self.graph_batch + 1, dtype=torch.int32, device="cuda"),
                    "paged_kv_indices_buffer": torch.zeros(graph_max_pages, dtype=torch.int32, device="cuda"),
                    "paged_kv_last_page_len_buffer": torch.zeros(self.graph_batch, dtype=torch.int32,
                                                                 device="cuda"),
                }
                graph = {"use_cuda_graph": True, **self.buffers}
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=bool(use_tensor_cores), **graph
            )
        except Exception as exc:
            raise FlashInferUnavailableError(
                f"FlashInfer's decode wrapper could not be created ({type(exc).__name__}: {str(exc)[:200]})."
            ) from exc
        self._batch_size: int | None = None
        self._proven = False  # becomes True after the first plan+run succeeded
        self._pinned_ranges: dict[int, torch.Tensor] = {}  # see _pinned_range_table()

    def _pinned_range_table(self, n: int):
        """FlashInfer's ``plan()`` also copies a range table ``arange(n)`` (its ``qo_indptr``) to the GPU
        with ``non_blocking``, from a host tensor it caches itself (``flashinfer.utils._cache_buf``,
        key ``("range_<n rounded up to a power of two>", "cpu")``), pageable. Returns ``(cache, key,
        old)`` after putting this wrapper's pinned copy of that table in the cache for one ``plan()``
        (:meth:`plan` puts ``old`` back after it), or None where FlashInfer's cache is not as expected
        (then ``plan()`` copies its own pageable table, as it always did)."""
        try:
            from flashinfer import utils as fi_utils

            cache, ceil_pow2 = fi_utils._cache_buf, fi_utils._ceil_pow2
            size = int(ceil_pow2(n))
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        if not isinstance(cache, dict) or size < n:
            return None
        table = self._pinned_ranges.get(size)
        if table is None:  # one per size, kept with the wrapper: never rewritten, freed with it
            table = self._pinned_ranges[size] = torch.arange(size, dtype=torch.int32).pin_memory()
        key = (f"range_{size}", "cpu")
        old = cache.get(key)
        cache[key] = table
        return cache, key, old

    def _first_use(self, what: str, fn):
        if self._proven:
            return fn()
        try:
            return fn()
        except Exception as exc:
            raise FlashInferUnavailableError(
                f"FlashInfer's first {what}() failed, most likely its kernel JIT build "
                f"({type(exc).__name__}: {str(exc)[:200]})."
            ) from exc

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        *,
        sm_scale: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        """Plan one decode step. Pass ``indptr``/``last_page_len`` as CPU tensors and ``indices``
        on the GPU: a GPU indptr makes ``plan()`` copy it back to the host (a sync).

        FlashInfer's ``plan()`` copies ``indptr``, ``last_page_len`` and a range table of its own to
        the GPU with ``non_blocking=True``: from pageable host tensors the driver stages each of them,
        and each may wait for the GPU (lesson 02). When ``indptr`` and ``last_page_len`` are pinned, the
        range table is handed to it pinned too, for this call only (:meth:`_pinned_range_table`): no
        pageable copy."""
        indptr = _int_tensor("indptr", indptr, ndim=1, dtypes=(torch.int32,))
        indices = _int_tensor("indices", indices, ndim=1, dtypes=(torch.int32,))
        last_page_len = _int_tensor("last_page_len", last_page_len, ndim=1, dtypes=(torch.int32,))
        if indptr.numel() != last_page_len.numel() + 1:
            raise ValueError(
                f"indptr must have len(last_page_len) + 1 = {last_page_len.numel() + 1} entries, got {indptr.numel()}"
            )
        if sm_scale is not None:
            sm_scale = positive_number("sm_scale", sm_scale)

        def call():
            swap = (self._pinned_range_table(indptr.numel())
                    if indptr.device.type == "cpu" and indptr.is_pinned() and last_page_len.is_pinned() else None)
            try:
                self.wrapper.plan(
                    indptr, indices, last_page_len,
                    self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                    pos_encoding_mode="NONE",
                    q_data_type=self.dtype,
                    kv_data_type=self.dtype,
                    sm_scale=sm_scale,
                    non_blocking=non_blocking,
                )
            finally:
                if swap is not None:  # FlashInfer's own cache as it was: nothing pinned outlives the wrapper
                    cache, key, old = swap
                    if old is None:
                        cache.pop(key, None)
                    else:
                        cache[key] = old

        self._first_use("plan", call)
        self._batch_size = last_page_len.numel()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Decode attention for the planned batch: q [B, num_qo_heads, head_dim] -> same shape."""
        if self._batch_size is None:
            raise RuntimeError("call plan(indptr, indices, last_page_len) before run()")
        want_q = (self._batch_size, self.num_qo_heads, self.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != want_q:
            raise ValueError(f"q must have shape {want_q} (the planned batch), got {getattr(q, 'shape', type(q).__name__)}")
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} must be {self.dtype} like this wrapper, got {t.dtype}")
        if k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != (self.page_size, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"k_cache must be [num_pages, {self.page_size}, {self.num_kv_heads}, {self.head_dim}] (NHD), "
                f"got {tuple(k_cache.shape)}"
            )
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
        out = self._first_use("run", lambda: self.wrapper.run(q, (k_cache, v_cache)))
        self._proven = True
        return out


# --------------------------------------------------------------------------- random batches

class RandomBatch(NamedTuple):
    """A random decode batch: q and k/v caches on the device, block table on the device,
    sequence lengths on the host."""

    q: torch.Tensor
    """[B, num_qo_heads, head_dim]"""
    k_cache: torch.Tensor
    """[num_pages_total, page_size, num_kv_heads, head_dim] (NHD)"""
    v_cache: torch.Tensor
    block_table: torch.Tensor
    """int32 [B, ceil(max_seq_len / page_size)]; all page ids in it are distinct."""
    seq_lens: torch.Tensor
    """int32 [B] on the CPU."""


def random_batch(
    batch_size: int,
    max_seq_len: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    num_qo_heads: int,
    *,
    seed: int,
    device="cpu",
    dtype: torch.dtype = torch.float16,
) -> RandomBatch:
    """A reproducible random batch (same ``seed``, same values on any device).

    Sequence lengths lie in 0..max_seq_len; about one in eight is 0 and one in four is a
    multiple of page_size. Page ids come from a shuffled pool with some spare pages, so no
    page is shared and some pages of the cache belong to no request.
    """
    batch_size = positive_int("batch_size", batch_size)
    max_seq_len = positive_int("max_seq_len", max_seq_len, allow_zero=True)
    page_size = positive_int("page_size", page_size)
    num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
    head_dim = positive_int("head_dim", head_dim)
    num_qo_heads = positive_int("num_qo_heads", num_qo_heads)
    seed = positive_int("seed", seed, allow_zero=True, maximum=2**63 - 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    device = _device_arg(device, "random_batch")

    width = -(-max_seq_len // page_size)
    pool = batch_size * width + max(1, batch_size // 2)  # spare pages that no request uses
    for what, n in (("each of k_cache and v_cache", pool * page_size * num_kv_heads * head_dim),
                    ("q", batch_size * num_qo_heads * head_dim)):
        if n > MAX_RANDOM_ELEMENTS:
            raise ValueError(
                f"random_batch would allocate {n} elements for {what} (at most {MAX_RANDOM_ELEMENTS}): "
                "make batch_size, max_seq_len, num_kv_heads, num_qo_heads or head_dim smaller"
            )
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_seq_len + 1, (batch_size,), generator=g)
    kind = torch.rand(batch_size, generator=g)
    aligned = torch.randint(0, max_seq_len // page_size + 1, (batch_size,), generator=g) * page_size
    lens = torch.where(kind < 0.25, aligned, lens)
    lens = torch.where(kind > 0.875, torch.zeros_like(lens), lens)

    perm = torch.randperm(pool, generator=g)
    block_table = perm[: batch_size * width].reshape(batch_size, width).to(torch.int32)
    shape = (pool, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn((batch_size, num_qo_heads, head_dim), generator=g).to(dtype)
    return RandomBatch(
        q.to(device), k_cache.to(device), v_cache.to(device), block_table.to(device), lens.to(torch.int32)
    )
