"""Lesson 06: build indices on the device. Qwen2-VL's vision rotary position ids without an H2D copy.

The three builders the lesson compares (each short enough to read in the notebook, which prints
their source), all returning ``pos_ids`` ``[sum(t*h*w), 2]`` (int64: row, column) on ``device``:

* :func:`ids_before` (a): vLLM 0.28. Built on the CPU with arange / expand / reshape / permute per
  image, then ``.to(cos.device, non_blocking=True)``: a pageable H2D copy. (HF transformers 4.x builds
  the same CPU ids but has no ``.to``: it indexes the GPU table with the CPU index tensor; docs/facts.md F13);
* :func:`ids_per_image` (b): the PR (vLLM 0.29). The same chain per image, built on the device (for
  Qwen2-VL vLLM 0.29 passes ``device=self.device``; ``device=cos.device``, with ``get_cos_sin`` first, is
  its Qwen2.5-VL form, which this module follows: docs/facts.md F12): no copy, but one launch chain per image;
* :func:`ids_vectorised` (c): beyond the PR. One construction for every image: a small table
  with one row per image goes to the device in one pinned ``non_blocking`` copy
  (:func:`pinlab.async_tensor_h2d`), ``repeat_interleave(..., output_size=N)`` (no host sync)
  expands it to one row per token, and the closed form turns the token index into (row, col).
  A fixed number of launches, whatever the number of images;
* :func:`ids_recommended`: (b) for a batch of one image or video (no copy, one short chain),
  (c) otherwise.

:class:`VisionRotary` is vLLM's rotary table (``get_rope(..., partial_rotary_factor=0.5)``) and
:func:`rot_pos_emb` the ``cos[pos_ids].flatten(1)`` gather. :func:`adaptive_enc_mask` is Phi-4-MM's
streaming audio mask built on the host, :func:`streaming_mask_device` the same mask built on the
device. :class:`TorchCalls` counts torch calls (and, on a :class:`pinlab.LaggingStream`, H2D
copies and host syncs) without a GPU.

GPU experiments (:func:`builder_times`, :func:`builder_step_loop`, :func:`launch_counts`,
:func:`mask_times`) take ``stream=None`` (the CUDA stream, or :class:`CudaUnavailableError`); a
:class:`pinlab.LaggingStream` runs them on a CPU with the same result schema (GPU-only fields
``None``), which is how the tests check them. This module is over 500 lines because it holds the
lesson's reference code *and* its experiments; the reference half is what the checkers import.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..args import positive_int, positive_number
from ..busy import MAX_BUSY_MS
from ..claims import Reasons
from ..copyargs import copy_call
from ..device import require_cuda
from ..h2d import async_tensor_h2d
from ..plots import MAX_WIDTH_IN, color_for, legend_outside
from ..streams import _tensors  # one walker over nested args (streams.py)
from ..timing import interleaved

#: Upper bounds on what the lesson's functions are given; each is far above the lesson's own sizes
#: (beyond them is a typo that would allocate gigabytes or run for hours, not a lesson):
#: a batch of at most 1024 images or videos (the lesson's largest: 32) and 2**24 tokens (its random
#: batches reach 32 videos of 4 frames of 128 x 128 = 2**21);
MAX_IMAGES = 1024
MAX_TOKENS = 2**24
#: a rotary table of at most 2**17 positions (vLLM's 8192) and head_dim 1024 (Qwen2-VL's 80);
MAX_POSITION = 2**17
MAX_HEAD_DIM = 1024
#: a streaming mask of at most 8192 frames (the lesson's: 750; the mask is x_len**2 bools);
MAX_MASK_LEN = 8192
#: experiments of at most 10,000 steps or rounds (the lesson's: 20 steps, 15 rounds).
MAX_STEPS = 10_000

# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------


def check_grid(grid_thw, merge_size) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of ``(t, h, w)`` ints, checked; clear errors naming the argument.

    ``grid_thw``: a list of ``(t, h, w)`` rows (vLLM passes ``list[list[int]]``) or a CPU integer
    tensor of shape ``[n, 3]``. A GPU tensor is refused: reading its values on the host would
    make the host wait for the GPU.
    """
    if type(merge_size) is int and merge_size > 0 and type(grid_thw) in (list, tuple) and grid_thw:
        fast = _fast_rows(grid_thw, merge_size)  # the common case, in a few µs
        if fast is not None:
            return _bounded(fast)
    m = positive_int("merge_size", merge_size)
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.device.type != "cpu":
            raise ValueError(f"grid_thw is on {grid_thw.device}: pass the host copy (a list of (t, h, w) "
                             "rows or a CPU tensor); reading a GPU tensor's values makes the host wait")
        if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
            raise TypeError(f"grid_thw must hold integers (t, h, w), got dtype {grid_thw.dtype}")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [n, 3] (one (t, h, w) row per image), "
                             f"got {list(grid_thw.shape)}")
        rows = grid_thw.tolist()
    elif isinstance(grid_thw, (list, tuple)):
        rows = list(grid_thw)
    else:
        raise TypeError(f"grid_thw must be a list of (t, h, w) rows or a CPU integer tensor, "
                        f"got {type(grid_thw).__name__}")
    if not rows:
        raise ValueError("grid_thw is empty: give at least one (t, h, w) row")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise ValueError(f"grid_thw[{i}] must be a (t, h, w) row of 3 ints, got {row!r}"[:200])
        t, h, w = (positive_int(f"grid_thw[{i}].{k}", v) for k, v in zip("thw", row))
        for k, v in (("h", h), ("w", w)):
            if v % m:
                raise ValueError(f"grid_thw[{i}]: {k}={v} is not a multiple of merge_size={m} "
                                 f"(the m x m merge blocks must tile the frame)")
        out.append((t, h, w))
    return _bounded(out)


def _bounded(grid):
    """``grid`` itself, if the batch is of a size a lesson builds (:data:`MAX_IMAGES`, :data:`MAX_TOKENS`)."""
    if len(grid) > MAX_IMAGES:
        raise ValueError(f"grid_thw has {len(grid)} rows: at most MAX_IMAGES = {MAX_IMAGES} images or videos")
    tokens = sum(t * h * w for t, h, w in grid)
    if tokens > MAX_TOKENS:
        raise ValueError(f"grid_thw makes {tokens} tokens (sum of t * h * w): at most MAX_TOKENS = {MAX_TOKENS}")
    return grid


def _fast_rows(rows, m):
    """The rows as tuples when every one is a valid (t, h, w) of Python ints; None otherwise
    (then :func:`check_grid` looks again, slowly, to say what is wrong)."""
    out = []
    for row in rows:
        if type(row) not in (list, tuple) or len(row) != 3:
            return None
        t, h, w = row
        if not (type(t) is int and type(h) is int and type(w) is int and t > 0 and h > 0 and w > 0
                and h % m == 0 and w % m == 0):
            return None
        out.append((t, h, w))
    return out


def as_device(device) -> torch.device:
    """``device`` as a ``torch.device``; TypeError/ValueError naming ``device`` otherwise."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device must name a device such as 'cuda' or 'cpu', got {device!r}") from exc
    raise TypeError(f"device must be a torch.device or a str such as 'cuda', got {type(device).__name__}")


def max_grid_size(grid) -> int:
    """The largest h or w of the batch: how many rows of the rotary table the ids can reach."""
    return max(max(h, w) for _, h, w in grid)


def num_tokens(grid) -> int:
    return sum(t * h * w for t, h, w in grid)


# ---------------------------------------------------------------------------------------------
# the three builders (the notebook prints their source)
# ---------------------------------------------------------------------------------------------


def ids_before(grid_thw, merge_size, device):
    """(a) vLLM 0.28: built on the CPU per image, then one pageable ``non_blocking`` H2D copy."""
    grid, m = check_grid(grid_thw, merge_size), merge_size
    pos_ids = []
    for t, h, w in grid:
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w)        # row index of every patch
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1)        # column index
        hpos = hpos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()  # block-major order
        wpos = wpos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        pos_ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))  # same positions every frame
    return torch.cat(pos_ids, dim=0).to(as_device(device), non_blocking=True)  # pageable -> device


def ids_per_image(grid_thw, merge_size, device):
    """(b) the PR: the same chain per image, built on the device (no copy; one chain per image)."""
    grid, m, device = check_grid(grid_thw, merge_size), merge_size, as_device(device)
    pos_ids = []
    for t, h, w in grid:
        hpos = torch.arange(h, device=device).unsqueeze(1).expand(-1, w)
        wpos = torch.arange(w, device=device).unsqueeze(0).expand(h, -1)
        hpos = hpos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        wpos = wpos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        pos_ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(pos_ids, dim=0)


def ids_vectorised(grid_thw, merge_size, device):
    """(c) one construction for all images: one small pinned copy, a fixed number of launches."""
    grid, m, device = check_grid(grid_thw, merge_size), merge_size, as_device(device)
    counts = [t * h * w for t, h, w in grid]                  # host arithmetic: no launches
    starts = itertools.accumulate(counts, initial=0)
    # one row per image: its token count, where its tokens start, its frame size h*w, w/m
    table = [[n, s, h * w, w // m] for n, s, (_, h, w) in zip(counts, starts, grid)]
    table = to_device_once(table, device)                     # one small pinned non_blocking copy
    total = sum(counts)                                       # known on the host: no sync needed
    per_token = torch.repeat_interleave(table[:, 1:], table[:, 0], dim=0, output_size=total)
    start, frame, blocks_per_row = per_token.unbind(1)
    k = (torch.arange(total, device=device) - start) % frame  # token index inside its frame
    b, r = k // (m * m), k % (m * m)                          # merge block, place inside the block
    row = (b // blocks_per_row) * m + r // m
    col = (b % blocks_per_row) * m + r % m
    return torch.stack([row, col], dim=-1)


def to_device_once(rows, device: torch.device) -> torch.Tensor:
    """A small int64 table on ``device``: on CUDA one pinned ``non_blocking`` copy
    (:func:`pinlab.async_tensor_h2d`); on a CPU device it is made in place (no copy to make)."""
    if device.type == "cuda":
        return async_tensor_h2d(rows, torch.int64, device)
    return torch.tensor(rows, dtype=torch.int64, device=device)


#: A batch of at most this many images or videos is built per image (b); a larger one at once (c).
PER_IMAGE_MAX = 1


def ids_recommended(grid_thw, merge_size, device):
    """The builder the lesson recommends: (b) for one image or video (no copy and no table: the
    shortest chain), (c) for more (a fixed number of launches instead of one chain per image)."""
    grid = check_grid(grid_thw, merge_size)
    builder = ids_per_image if len(grid) <= PER_IMAGE_MAX else ids_vectorised
    return builder(grid, merge_size, device)


BUILDERS = {"a": ids_before, "b": ids_per_image, "c": ids_vectorised, "rec": ids_recommended}
LABELS = {"a": "(a) CPU + pageable copy", "b": "(b) per image on the device",
          "c": "(c) vectorised on the device", "rec": "recommended"}


# ---------------------------------------------------------------------------------------------
# the rotary table and the gather
# ---------------------------------------------------------------------------------------------


class VisionRotary:
    """vLLM's vision rotary table for Qwen2-VL (``get_rope(head_size, max_position=8192,
    is_neox_style=True, partial_rotary_factor=0.5)``): ``rotary_dim = head_dim / 2``,
    ``freq_j = 1 / theta ** (2j / rotary_dim)``; ``cos_sin_cache`` ``[max_position, rotary_dim]``
    lives on ``device``."""

    def __init__(self, head_dim: int = 80, device="cpu", theta: float = 10000.0, max_position: int = 8192):
        head_dim = positive_int("head_dim", head_dim, maximum=MAX_HEAD_DIM)
        if head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4, got {head_dim}")
        self.max_position = positive_int("max_position", max_position, maximum=MAX_POSITION)
        theta = positive_number("theta", theta)
        device = as_device(device)
        if device.type == "cuda":
            require_cuda(f"VisionRotary(device={str(device)!r})")
        rotary_dim = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=device), inv_freq)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.device = device

    def get_cos_sin(self, seqlen: int):
        """``cos_sin_cache[:seqlen].chunk(2, -1)``: each ``[seqlen, head_dim / 4]`` (views, no copy)."""
        if type(seqlen) is not int:  # a bool is not a length; numpy ints are
            seqlen = positive_int("seqlen", seqlen)
        if not 0 < seqlen <= self.max_position:
            raise ValueError(f"seqlen must be in 1..{self.max_position}, got {seqlen}")
        return self.cos_sin_cache[:seqlen].chunk(2, dim=-1)


def rot_pos_emb(builder, grid_thw, merge_size, rope: VisionRotary):
    """cos/sin first, then the ids on ``cos.device``, then the gather: ``(cos, sin)`` each
    ``[N, head_dim / 2]``, the h-frequencies first, then the w-frequencies."""
    grid = check_grid(grid_thw, merge_size)
    cos, sin = rope.get_cos_sin(max_grid_size(grid))
    pos_ids = builder(grid, merge_size, cos.device)
    return cos[pos_ids].flatten(1), sin[pos_ids].flatten(1)


# ---------------------------------------------------------------------------------------------
# random batches (the property tests, the live equivalence, the checkers)
# ---------------------------------------------------------------------------------------------


def random_grid(rng, merge_size: int = 2, max_images: int = 32, max_side: int = 128, max_t: int = 4):
    """A random batch: 1..``max_images`` rows, images (t=1) and videos (t in 2..max_t) mixed,
    h and w multiples of ``merge_size`` up to ``max_side``."""
    if not (callable(getattr(rng, "randint", None)) and callable(getattr(rng, "random", None))):
        raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
    m = positive_int("merge_size", merge_size)
    max_images = positive_int("max_images", max_images, maximum=MAX_IMAGES)
    max_side = positive_int("max_side", max_side)
    max_t = positive_int("max_t", max_t)
    if max_side < m:
        raise ValueError(f"max_side ({max_side}) must be >= merge_size ({m}): a side is a multiple of merge_size")
    rows = []
    for _ in range(rng.randint(1, max_images)):
        t = 1 if max_t == 1 or rng.random() < 0.6 else rng.randint(2, max_t)
        rows.append([t, m * rng.randint(1, max_side // m), m * rng.randint(1, max_side // m)])
    return rows


def equivalent(grid, merge_size, rope: VisionRotary) -> dict:
    """Build ``grid`` with every builder on ``rope.device``: are the ids and the embeddings equal?"""
    ids = {k: f(grid, merge_size, rope.device) for k, f in BUILDERS.items()}
    emb = {k: rot_pos_emb(f, grid, merge_size, rope) for k, f in BUILDERS.items()}
    ref_ids, ref_emb = ids["a"], emb["a"]
    return {
        "ids_equal": all(torch.equal(v, ref_ids) for v in ids.values()),
        "emb_equal": all(torch.equal(v[0], ref_emb[0]) and torch.equal(v[1], ref_emb[1]) for v in emb.values()),
        "dtype_int64": all(v.dtype == torch.int64 for v in ids.values()),
        "tokens": int(ref_ids.shape[0]),
    }


# ---------------------------------------------------------------------------------------------
# counting torch calls, H2D copies and host syncs (any machine)
# ---------------------------------------------------------------------------------------------

#: Calls that read a device value on the host (a sync on a real GPU).
SYNC_CALLS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy",
              "cpu", "unique", "masked_select", "__array__", "__repr__", "__format__"}


#: Calls that may take host and device tensors together (a copy, an index on the host, a factory given
#: host data); any other call given both would raise on a GPU ("Expected all tensors to be on the same device").
MIXED_OK = {"copy_", "to", "cuda", "cpu", "__getitem__", "__setitem__", "index_put_", "index_put", "pin_memory",
            "is_pinned", "__get__", "type_as", "tensor", "as_tensor", "asarray"}




def _default_device_context():
    """torch's global default-device context (``torch.set_default_device``; torch/__init__.py keeps it in
    ``_GLOBAL_DEVICE_CONTEXT.device_context``), or None."""
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


class TorchCalls(TorchFunctionMode):
    """Count the torch calls made inside ``with TorchCalls(stream) as c:`` (``c.calls``), and on a
    :class:`pinlab.LaggingStream` (``stream``) also:

    - the H2D copies (``c.h2d``: dicts with ``kind`` "pinned" / "pageable" / "blocking", ``call`` and
      ``nbytes``), told by where the stream put the result (``t.to(...)`` that gave device memory from
      host memory) and with ``non_blocking`` read by :func:`pinlab.copyargs.copy_call` in every form
      torch accepts (``copy_(src, True)``, ``to(device, dtype, True)``, ``cuda(device, True)``);
    - the host syncs (``c.syncs``: call names);
    - the factory calls that made device memory (``c.device_factories``);
    - the calls that mixed device tensors with host tensors of one or more dimensions (``c.mixed``: dicts
      with ``call`` and ``shape``, the host tensor's), which a GPU refuses (:data:`MIXED_OK` excepted);
    - ``c.default_device``: what ``torch.set_default_device`` was set to during the block (None: untouched).

    Without a stream only ``calls`` and ``names`` are counted (and ``default_device``)."""

    def __init__(self, stream=None):
        super().__init__()
        self.s = stream
        self.calls = 0
        self.names: dict[str, int] = {}
        self.h2d: list[dict] = []
        self.syncs: list[str] = []
        self.device_factories = 0
        self.mixed: list[dict] = []
        self.default_device: str | None = None
        self._ctx = _default_device_context()

    def _dev(self, t) -> bool:
        return self.s is not None and isinstance(t, torch.Tensor) and self.s.is_device(t)

    def _note_copy(self, src, non_blocking, call):
        if not non_blocking:
            kind = "blocking"
        else:
            kind = "pinned" if self.s.is_pinned(src) else "pageable"
        self.h2d.append({"kind": kind, "call": call, "nbytes": src.numel() * src.element_size()})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        self.calls += 1
        self.names[name] = self.names.get(name, 0) + 1
        ctx = _default_device_context()
        if ctx is not self._ctx and self.default_device is None:
            self.default_device = str(ctx.device) if ctx is not None else "None"
        # the emulated GPU running its queue: the calls of work already seen when it was queued
        watch = self.s is not None and not getattr(self.s, "_draining", False)
        if watch:
            self._before(name, args, kwargs)
        out = func(*args, **kwargs)
        if watch:
            self._after(name, args, kwargs, out)
        return out

    def _before(self, name, args, kwargs):
        first = args[0] if args else None
        if name not in MIXED_OK and not name.endswith("_like") and not name.startswith("new_"):
            tensors = list(_tensors((args, kwargs)))
            host = [t for t in tensors if t.dim() > 0 and not self._dev(t)]
            if host and any(self._dev(t) for t in tensors):
                self.mixed.append({"call": name, "shape": list(host[0].shape)})
        if name in SYNC_CALLS and self._dev(first):
            self.syncs.append(f".{name}()")
            return
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            reps = kwargs.get("repeats", args[1] if len(args) > 1 else first)
            if isinstance(reps, torch.Tensor) and self._dev(reps):
                self.syncs.append("repeat_interleave without output_size")

    def _after(self, name, args, kwargs, out):
        first = args[0] if args else None
        if name in ("to", "cuda") and isinstance(first, torch.Tensor):
            non_blocking = copy_call(name, args, kwargs).non_blocking  # every form (pinlab.copyargs)
            if not self._dev(first) and self._dev(out):
                self._note_copy(first, non_blocking, f".{name}()")
            elif self._dev(first) and isinstance(out, torch.Tensor) and not self._dev(out) and not non_blocking:
                self.syncs.append(f".{name}('cpu')")
            return
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            if self._dev(first) and not self._dev(args[1]):
                self._note_copy(args[1], copy_call(name, args, kwargs).non_blocking, ".copy_()")
            return
        if name == "__setitem__" and len(args) >= 3 and self._dev(first):
            value = args[2]
            if isinstance(value, torch.Tensor) and not self._dev(value):  # gpu[...] = host tensor: blocking
                self._note_copy(value, False, "[...] = host tensor")
            return
        if name == "__getitem__" and self._dev(first) and len(args) > 1:
            index = [t for t in _tensors(args[1:]) if not self._dev(t)]
            if index:  # gpu[host index tensor]: torch copies the index to the device first, blocking
                self._note_copy(index[0], False, "[host index tensor]")
            return
        if not self._dev(out) or (isinstance(first, torch.Tensor) and self._dev(first) and name in (
                "tensor", "as_tensor", "asarray")):
            return
        if name in ("tensor", "as_tensor", "asarray"):
            self.h2d.append({"kind": "blocking", "call": f"torch.{name}(..., device=...)",
                             "nbytes": out.numel() * out.element_size()})
        elif kwargs.get("device") is not None:
            self.device_factories += 1  # torch.arange(..., device=device) and friends


def count_calls(fn, *args, stream=None) -> TorchCalls:
    """Run ``fn(*args)`` under a :class:`TorchCalls` and return the counter."""
    with TorchCalls(stream) as c:
        fn(*args)
    return c


# ---------------------------------------------------------------------------------------------
# Phi-4-MM's streaming audio mask: on the host (the model's code) and on the device
# ---------------------------------------------------------------------------------------------


def _mask_args(x_len, chunk_size, left_window, right_window):
    return (positive_int("x_len", x_len, maximum=MAX_MASK_LEN), positive_int("chunk_size", chunk_size),
            positive_int("left_window", left_window, allow_zero=True),
            positive_int("right_window", right_window, allow_zero=True))


def adaptive_enc_mask(x_len, chunk_size, left_window=0, right_window=0):
    """Phi-4-MM's audio encoder mask (``adaptive_enc_mask`` with ``chunk_start_idx =
    arange(0, x_len, chunk_size)``), built on the host as the model does: ``[x_len, x_len]`` bool,
    True where frame i may attend to frame j."""
    x_len, chunk_size, left_window, right_window = _mask_args(x_len, chunk_size, left_window,
                                                               right_window)
    chunk_start_idx = torch.arange(0, x_len, chunk_size)
    start_pad = torch.nn.functional.pad(chunk_start_idx, (1, 0))
    end_pad = torch.nn.functional.pad(chunk_start_idx, (0, 1), value=x_len)
    seq_range = torch.arange(0, x_len).unsqueeze(-1)
    idx = ((seq_range < end_pad) & (seq_range >= start_pad)).nonzero()[:, 1]
    seq_range_expand = torch.arange(0, x_len).unsqueeze(0).expand(x_len, -1)
    idx_left = (idx - left_window).clamp(min=0)
    mask_left = seq_range_expand >= start_pad[idx_left].unsqueeze(-1)
    idx_right = (idx + right_window).clamp(max=len(chunk_start_idx))
    mask_right = seq_range_expand < end_pad[idx_right].unsqueeze(-1)
    return mask_left & mask_right


def streaming_mask_device(x_len, chunk_size, left_window, right_window, device):
    """The same mask built on ``device``: frame i may attend to frame j when j's chunk is at most
    ``left_window`` chunks before and ``right_window`` chunks after i's. Six launches, no copy."""
    x_len, chunk_size, left_window, right_window = _mask_args(x_len, chunk_size, left_window,
                                                               right_window)
    chunk = torch.arange(x_len, device=as_device(device)) // chunk_size
    d = chunk.unsqueeze(0) - chunk.unsqueeze(1)               # j's chunk minus i's chunk
    return (d >= -left_window) & (d <= right_window)


MASK_FORMS = {"host_pageable": "host build + .to(non_blocking) (pageable)",
              "host_async": "host build + async_tensor_h2d (pinned)",
              "device": "built on the device"}


# ---------------------------------------------------------------------------------------------
# GPU experiments (``stream=None``: the CUDA stream; a LaggingStream runs them on a CPU)
# ---------------------------------------------------------------------------------------------

#: The grid mixes the lesson times: name -> list of (t, h, w) rows (merge size 2).
MIXES = {
    "one large image": [[1, 98, 146]],
    "one video": [[8, 36, 64]],
    "8 small images": [[1, 16, 16]] * 8,
    "32 small images": [[1, 16, 16]] * 32,
    "mixed batch": [[1, 32, 32], [1, 64, 48], [2, 28, 40], [1, 16, 24], [4, 20, 20]],
}


def _stream(stream):
    if stream is None:
        from ..streams import CudaStream

        return CudaStream()
    return stream


def _check_mixes(mixes, merge_size):
    if not isinstance(mixes, dict) or not mixes:
        raise TypeError("mixes must be a non-empty dict {name: grid_thw}")
    return {name: check_grid(g, merge_size) for name, g in mixes.items()}


def _sync(s):
    s.synchronize()


def _call(builder, grid, m, rope, s=None):
    if s is not None and s.emulated:
        # the emulation does not run its queue for an index tensor read by ``cos[pos_ids]``
        # (indexing counts as a view there), so the ids are made ready first
        cos, sin = rope.get_cos_sin(max_grid_size(grid))
        pos_ids = builder(grid, m, cos.device)
        s.synchronize()
        return cos[pos_ids].flatten(1), sin[pos_ids].flatten(1)
    return rot_pos_emb(builder, grid, m, rope)


def builder_times(mixes=None, merge_size: int = 2, rounds: int = 15, busy_ms: float = 10.0,
                  head_dim: int = 80, stream=None) -> dict:
    """Host µs per call (GPU kept busy ``busy_ms`` ahead: what the host pays) and end-to-end µs
    (GPU idle: call, then synchronize) for every builder and mix, builders interleaved round by
    round (rotated order), medians. Every kernel is warmed up first. In each round a builder's
    end-to-end call comes first and its host-timed call right after it, so every host time is
    taken after the same builder's own code, as in an engine that calls one builder step after
    step. (On the first H200 run, with each host time taken after the previous builder's call,
    the recommended builder and the builder it chose, the same code, read clearly different
    host times: likely the CPU's caches, warm or cold for the code by what ran just before.)

    Returns ``{"builders": [...], "mixes": {mix: {"tokens", "images", builder: {"host_us",
    "e2e_us"}}}}``.
    """
    s = _stream(stream)
    mixes = _check_mixes(MIXES if mixes is None else mixes, merge_size)
    rounds = positive_int("rounds", rounds, maximum=MAX_STEPS)
    busy_ms = positive_number("busy_ms", busy_ms, maximum=MAX_BUSY_MS)
    rope = VisionRotary(head_dim, device=s.device)
    keys = list(BUILDERS)
    for grid in mixes.values():  # warm up every kernel (lazy module loading blocks first launches)
        for k in keys:
            _call(BUILDERS[k], grid, merge_size, rope, s)
    s.busy(1.0)
    _sync(s)
    out = {"builders": keys, "mixes": {}}
    for name, grid in mixes.items():
        def one(k, _r, grid=grid):
            t0 = time.perf_counter()
            _call(BUILDERS[k], grid, merge_size, rope, s)
            _sync(s)
            e2e_us = (time.perf_counter() - t0) * 1e6
            s.busy(busy_ms)  # the host call right after the same builder's call, as in an engine
            t0 = time.perf_counter()
            _call(BUILDERS[k], grid, merge_size, rope, s)
            host_us = (time.perf_counter() - t0) * 1e6
            _sync(s)
            return host_us, e2e_us

        runs = interleaved(keys, rounds, one)
        host = {k: [h for h, _ in v] for k, v in runs.items()}
        e2e = {k: [e for _, e in v] for k, v in runs.items()}
        out["mixes"][name] = {"tokens": num_tokens(grid), "images": len(grid),
                              **{k: {"host_us": statistics.median(host[k]), "e2e_us": statistics.median(e2e[k])}
                                 for k in keys}}
    return out


def builder_step_loop(mixes=None, merge_size: int = 2, steps: int = 20, warm_steps: int = 3,
                      encoder_ms: float = 1.0, in_flight: int = 2, head_dim: int = 80, stream=None) -> dict:
    """An encoder step loop with the run-ahead bounded like an engine's: step n first waits for
    step n-``in_flight``'s event, builds the rotary embeddings with one builder, then launches
    the "encoder" (a kernel of ``encoder_ms``). Per builder and mix, medians over the steps after
    the first ``in_flight`` (the run-ahead filled): ``ms_per_step`` (host time from one step's start
    to the next's), ``build_ms`` (the builder's host time), ``idle_ms`` (GPU time between one
    encoder's end and the next one's start, the builder's own small kernels included); and over the
    whole run ``wall_ms_per_step`` and ``gpu_idle_share`` (the share of the GPU's span outside the
    encoder kernels). The GPU figures come from CUDA events (None on an emulated stream).

    Returns ``{"encoder_ms", "in_flight", "mixes": {mix: {builder: {"ms_per_step", "build_ms",
    "idle_ms", "wall_ms_per_step", "gpu_idle_share"}}}}``.
    """
    s = _stream(stream)
    mixes = _check_mixes(MIXES if mixes is None else mixes, merge_size)
    steps = positive_int("steps", steps, maximum=MAX_STEPS)
    warm_steps = positive_int("warm_steps", warm_steps, allow_zero=True, maximum=MAX_STEPS)
    encoder_ms = positive_number("encoder_ms", encoder_ms, maximum=MAX_BUSY_MS)
    in_flight = positive_int("in_flight", in_flight, maximum=MAX_STEPS)
    rope = VisionRotary(head_dim, device=s.device)
    timed = not s.emulated

    def loop(builder, grid, n_steps):
        done = [s.Event() for _ in range(n_steps)]
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(n_steps)] if timed else None
        starts, builds = [], []
        _sync(s)
        t0 = time.perf_counter()
        for n in range(n_steps):
            starts.append(time.perf_counter())
            if n >= in_flight:
                done[n - in_flight].synchronize()  # bounded run-ahead, like an engine's batch queue
            b0 = time.perf_counter()
            _call(builder, grid, merge_size, rope, s)
            builds.append(time.perf_counter() - b0)
            if timed:
                marks[n][0].record()
            s.busy(encoder_ms)
            if timed:
                marks[n][1].record()
            done[n].record()
        _sync(s)
        end = time.perf_counter()
        steady = range(min(in_flight, n_steps - 1), n_steps)  # after the run-ahead has filled
        bounds = starts + [end]
        out = {"ms_per_step": statistics.median((bounds[n + 1] - bounds[n]) * 1e3 for n in steady),
               "build_ms": statistics.median(builds[n] * 1e3 for n in steady),
               "idle_ms": None, "wall_ms_per_step": (end - t0) * 1e3 / n_steps, "gpu_idle_share": None}
        if timed:
            busy = sum(a.elapsed_time(b) for a, b in marks)
            span = marks[0][0].elapsed_time(marks[-1][1])
            out["gpu_idle_share"] = max(0.0, 1.0 - busy / span) if span > 0 else None
            gaps = [marks[n - 1][1].elapsed_time(marks[n][0]) for n in steady if n >= 1]
            out["idle_ms"] = max(0.0, statistics.median(gaps)) if gaps else None
        return out

    out = {"encoder_ms": encoder_ms, "in_flight": in_flight, "mixes": {}}
    for name, grid in mixes.items():
        row = {}
        for k, f in BUILDERS.items():
            if warm_steps:
                loop(f, grid, warm_steps)
            row[k] = loop(f, grid, steps)
        out["mixes"][name] = row
    return out


def trace_counts(events, windows: dict) -> dict:
    """Per window of a Chrome trace (``{key: (start_us, end_us)}``, the builders' annotations):
    kernels run, H2D copies (by trace name), kernel launch calls and sync calls.

    Runtime calls (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cudaStreamSynchronize``, ...) belong
    to the window holding their start; a kernel or memcpy to the window of the runtime call with
    the same ``correlation`` id, or, in a trace without correlation ids, to the last window that
    started before it (the experiment keeps the windows 10 ms apart and synchronizes in between).
    Returns ``{key: {"kernels", "launches", "syncs", "h2d": [names]}}``.
    """
    out = {k: {"kernels": 0, "launches": 0, "syncs": 0, "h2d": []} for k in windows}
    order = sorted(windows, key=lambda k: windows[k][0])

    def window_of(ts):
        for k in order:
            if windows[k][0] <= ts <= windows[k][1]:
                return k
        return None

    corr, gpu = {}, []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        ts = float(e.get("ts", 0.0))
        cid = (e.get("args") or {}).get("correlation")
        if cat in ("cuda_runtime", "cuda_driver"):
            k = window_of(ts)
            if k is None:
                continue
            if cid is not None:
                corr[cid] = k
            if "LaunchKernel" in name:
                out[k]["launches"] += 1
            elif "Synchronize" in name:
                out[k]["syncs"] += 1
        elif cat == "kernel" or (cat == "gpu_memcpy" and "HtoD" in name):
            gpu.append((ts, cat, name, cid))
    for ts, cat, name, cid in gpu:
        if cid is not None and cid in corr:
            k = corr[cid]
        elif cid is None or not corr:
            started = [k for k in order if windows[k][0] <= ts + 2000.0]  # 2 ms of clock skew
            k = started[-1] if started else None
        else:
            k = None  # launched outside every window (the profiler's own work)
        if k is None:
            continue
        if cat == "kernel":
            out[k]["kernels"] += 1
        else:
            out[k]["h2d"].append(name)
    return out


def launch_counts(mixes=None, merge_size: int = 2, head_dim: int = 80, stream=None) -> dict:
    """One call of every builder (ids and the cos/sin gather) per mix, all in one
    ``torch.profiler`` session, each call in its own ``record_function`` window and followed by a
    synchronize and a 10 ms pause: kernels run, kernel launch calls, sync calls, and the H2D
    copies by trace name (``"Memcpy HtoD (Pinned -> Device)"`` / ``"(Pageable -> Device)"``)
    (:func:`trace_counts`). On an emulated stream: the builder's torch calls for
    ``kernels``/``launches`` and :class:`TorchCalls`' copies and syncs.

    Returns ``{"counted_by", "mixes": {mix: {builder: {"kernels", "launches", "syncs", "h2d"}}}}``.
    """
    s = _stream(stream)
    mixes = _check_mixes(MIXES if mixes is None else mixes, merge_size)
    rope = VisionRotary(head_dim, device=s.device)
    for grid in mixes.values():  # warm up every kernel first
        for f in BUILDERS.values():
            _call(f, grid, merge_size, rope, s)
    _sync(s)
    out = {"counted_by": "torch calls on the emulated stream" if s.emulated else "torch.profiler", "mixes": {}}
    if s.emulated:
        for name, grid in mixes.items():
            row = {}
            for k, f in BUILDERS.items():
                c = count_calls(f, grid, merge_size, s.device, stream=s)  # the ids only
                _sync(s)
                row[k] = {"kernels": c.calls, "launches": c.calls, "syncs": len(c.syncs),
                          "h2d": [f"{d['kind']} {d['call']}" for d in c.h2d]}
            out["mixes"][name] = row
        return out
    from torch.profiler import ProfilerActivity, profile, record_function

    tags = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i, (name, grid) in enumerate(mixes.items()):
            for k, f in BUILDERS.items():
                tag = f"06_build_{i}_{k}"
                tags[tag] = (name, k)
                with record_function(tag):
                    _call(f, grid, merge_size, rope, s)
                torch.cuda.synchronize()
                time.sleep(0.01)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text(encoding="utf-8"))
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    windows = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "X" and e.get("name") in tags \
                and not str(e.get("cat", "")).lower().startswith("gpu_"):
            windows.setdefault(e["name"], (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    missing = sorted(set(tags) - set(windows))
    if missing:
        raise RuntimeError(f"the profiler trace holds no annotation {missing[0]!r}")
    counts = trace_counts(events, windows)
    if not any(c["kernels"] for c in counts.values()):
        raise RuntimeError("the profiler recorded no GPU kernel (is CUPTI available?)")
    for tag, (name, k) in tags.items():
        out["mixes"].setdefault(name, {})[k] = counts[tag]
    return out


def mask_times(x_len: int = 750, chunk_size: int = 16, left_window: int = 3, right_window: int = 0,
               rounds: int = 15, busy_ms: float = 10.0, stream=None) -> dict:
    """Host µs per call (GPU busy ahead) of the three ways to get Phi-4-MM's streaming mask onto
    the device (:data:`MASK_FORMS`), interleaved, medians; and whether all three are equal.

    Returns ``{"bytes", "equal", "forms": {form: {"host_us"}}}``.
    """
    s = _stream(stream)
    rounds = positive_int("rounds", rounds, maximum=MAX_STEPS)
    busy_ms = positive_number("busy_ms", busy_ms, maximum=MAX_BUSY_MS)
    args = _mask_args(x_len, chunk_size, left_window, right_window)
    dev = s.device

    def host_async():
        if dev.type == "cuda":
            return async_tensor_h2d(adaptive_enc_mask(*args), device=dev)
        return adaptive_enc_mask(*args).pin_memory().to(dev, non_blocking=True)

    forms = {"host_pageable": lambda: adaptive_enc_mask(*args).to(dev, non_blocking=True),
             "host_async": host_async,
             "device": lambda: streaming_mask_device(*args, dev)}
    results = {k: f() for k, f in forms.items()}
    _sync(s)
    equal = all(torch.equal(v.cpu(), results["device"].cpu()) for v in results.values())
    def one(k, _r):
        s.busy(busy_ms)
        t0 = time.perf_counter()
        forms[k]()
        us = (time.perf_counter() - t0) * 1e6
        _sync(s)
        return us

    samples = interleaved(forms, rounds, one)
    return {"bytes": args[0] * args[0], "equal": equal,
            "forms": {k: {"host_us": statistics.median(v)} for k, v in samples.items()}}


# ---------------------------------------------------------------------------------------------
# reading the results
# ---------------------------------------------------------------------------------------------


def ratios_to_best(row: dict, keys=("a", "b", "c", "rec"), field: str = "host_us") -> dict:
    """``{builder: time / best time of (a), (b), (c)}`` for one mix of :func:`builder_times`."""
    best = min(row[k][field] for k in ("a", "b", "c"))
    if not best > 0 or not math.isfinite(best):
        raise ValueError(f"the best {field} must be a positive time, got {best}")
    return {k: row[k][field] / best for k in keys}


#: the notebook's tables: :func:`launch_counts` per mix and builder, :func:`builder_times` per mix
LAUNCH_COLUMNS = [("mix", "mix"), ("builder", "builder"), ("kernels", "kernels"), ("launches", "launch calls"),
                  ("syncs", "sync calls"), ("h2d", "H2D copies")]
TIME_COLUMNS = ([("mix", "mix"), ("tokens", "tokens")]
                + [(f"{k}_host_us", f"({k}) host µs", lambda v: f"{v:.0f}") for k in BUILDERS]
                + [(f"{k}_e2e_us", f"({k}) e2e µs", lambda v: f"{v:.0f}") for k in BUILDERS])


def per_builder(values: dict, fmt: str = "{:.2f}") -> str:
    """``"(a) 1.00, (b) 2.31, ..."``: one value per builder, for a printed line of the notebook."""
    return ", ".join(f"({k}) {fmt.format(v)}" for k, v in values.items())


#: why a claim of the notebook may not hold on some machine (``why=l06.WHY.name``)
WHY = Reasons(
    cpu_ints="integer arithmetic on the CPU: only a changed ids_before gives other positions",
    exact="integer ids and a gather of the same table are exact on any device: only a builder that computes "
          "other positions differs",
    counted="counted calls, not time: only a changed builder (or a torch that dispatches them differently) "
            "changes them",
    profiler="the profiler counts this process's kernels and copies, whoever else shares the GPU; only another "
             "torch version (other kernels per op) or a profiler that misses GPU activity changes the counts",
    rec_noise="it runs the code of the builder it chose, timed separately, so host-timing noise (a shared GPU, "
              "few CPU cores) moves its ratio; and where (b) and (c) cross depends on this host's launch cost",
    host_gaps="the host's step also holds the encoder's launch and the wait on an event, and a host that other "
              "processes slow down adds gaps of its own",
    mask_ints="comparisons of integers: only a changed mask builder differs",
    mask_copy="the same booleans built three ways: only a changed builder, or a copy read before it ran, differs",
    gpu_lead="each step puts 2 ms of GPU work before its copy, so the GPU falls further behind every step; only a "
             "host slower than the GPU's 2 ms per step could read after the copy ran",
    event="the event completes only after the step's copy has run, on any GPU",
)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------


def plot_by_mix(values: dict, *, ylabel: str, title: str, logy: bool = True, ax=None):
    """Grouped bars: ``values = {mix: {builder: value}}``, one group per mix, one bar per builder."""
    from ..plots import subplots

    if not isinstance(values, dict) or not values:
        raise TypeError("values must be a non-empty dict {mix: {builder: value}}")
    mixes = list(values)
    keys = [k for k in BUILDERS if all(k in values[m] for m in mixes)]
    if ax is None:
        _, ax = subplots(figsize=(MAX_WIDTH_IN, 3.8))
    width = 0.8 / max(len(keys), 1)
    for i, k in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(mixes))]
        ys = [values[m][k] if values[m][k] is not None else float("nan") for m in mixes]
        ax.bar(xs, ys, width, label=LABELS.get(k, k), color=color_for(LABELS.get(k, k)))
    ax.set_xticks(range(len(mixes)), mixes, rotation=10)
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    legend_outside(ax)
    return ax
