"""Lesson 07, the capstone: audit a small inference loop. The model, the harness and the audit.

The loop the learner audits (``planted_loop``) and its fix (``fixed_loop``) are short functions of
``(m, steps)``; notebook 07 defines the same ``planted_loop`` in a cell and prints what the harness
finds. ``fixed_loop`` is the exercise's reference answer: it exists only here, the notebook measures
it without showing it (a spoiler note points here), the checker's tests and the solution match it.
Everything else, the plumbing a real engine would hide, is :class:`CapstoneModel`:

* a toy decoder over a **paged KV cache** (:class:`pinlab.decode_loop.DecodeSetup`: requests grow,
  join and leave); each step the page indices are built **on the device** from the device copy of
  the step's ``indptr`` (the metadata the loop copies), then paged decode attention runs
  (FlashInfer's decode wrapper on CUDA when it can run, :func:`pinlab.decode_loop.torch_paged_decode`
  otherwise), then the **LM head** (a 4 MiB fp32 weight the loop offloads to host memory and
  restores every step, as a CPU-offloaded layer is) and an argmax give one token per request;
* a **vision encoder** step: its rotary position ids built on the device (lesson 06's
  :func:`~pinlab.lessons.l06_device_side_indices.ids_recommended`), the ``cos``/``sin`` gather,
  then ``encoder_ms`` of GPU work;
* FlashInfer's ``plan()`` gets step n's ``indptr`` and ``last_page_len`` as host tensors of the
  engine's own (never the loop's buffer): pageable, as vLLM 0.29 passes them, or, with
  ``pin_plan_inputs``, rows of one pinned table written once (vLLM 0.33 pins them), so that
  ``plan()`` makes no pageable copy (the harness's ``pinned_plan`` names the loops run that way);
* the host's own work: ``schedule(n, buf)`` writes step n's ``indptr`` and ``last_page_len`` into
  a host buffer, ``host_work()`` spends ``host_ms`` of CPU (the server, the detokenizer),
  ``emit(k, host_tokens)`` hands step k's tokens to the detokenizer (it reads them *now*),
  ``note_stop(k)`` records that a request of step k produced the end-of-sequence token.

:func:`run_loop` runs a loop on a :mod:`pinlab.streams` stream (CUDA, or the emulated
:class:`pinlab.LaggingStream`) under :class:`LoopAudit`, which records, with the line of the loop
that made it, every pageable ``non_blocking`` H2D copy, blocking copy, host sync (``.item()``, ``bool()``,
``x in tensor``, ``torch.equal``, device tokens handed to ``emit``, ``torch.cuda.synchronize()``...) and
``pin_memory()`` of an already pinned tensor, and whether it ran inside the loop (between step 0's decode
and the last step's); the loop runs on a stream that refuses what CUDA refuses (the emulated
one too: ``streams.py``); then it judges every step exactly
(:func:`judge`): did the metadata copy deliver this step's data, did the host read the tokens the
GPU computed, were the stops noted, is the LM head intact. GPU experiments: :func:`audit`,
:func:`throughput`, :func:`timeline`, :func:`detect`.

Why about 1,200 lines: the engine, the audit and the judge exist only for this capstone and are read
together; the two loops are the lesson's reference code, which the checker and the tests import; the
experiments (throughput, timelines, the stall detector's lines, the pytest gate's run) measure those same
loops, so they live beside them.
"""
from __future__ import annotations

import gc
import inspect
import os
import re
import sys
import textwrap
import time

import torch
from torch.overrides import TorchFunctionMode

from . import l06_device_side_indices as l06
from ..args import bool_arg, callable_arg, positive_int, positive_number
from ..claims import Reasons
from ..copyargs import copy_call
from ..decode_loop import DecodeSetup, match_received, safe_indptr, torch_paged_decode
from ..device import require_cuda
from ..paged_kv import FlashInferDecode, FlashInferUnavailableError, page_indices
from ..steploop import cuda_or
from ..text import fmt_bytes  # noqa: F401 - the audit's sizes; notebook 07 calls l07.fmt_bytes
from ..timing import interleaved

MiB = 1024 * 1024

#: The model's shapes on CUDA: those of lesson 03's decode (FlashInfer's kernels are then already built).
SHAPES = dict(max_batch=8, page_size=16, max_seq_len=256, num_qo_heads=8, num_kv_heads=2, head_dim=128)
#: On the emulated stream (CPU) the attention is smaller, to keep 1000 steps to seconds; the copies
#: the loop makes (metadata, LM head, tokens) have the same sizes.
SHAPES_EMULATED = dict(max_batch=8, page_size=16, max_seq_len=64, num_qo_heads=4, num_kv_heads=1, head_dim=32)
HIDDEN = 1024         # LM head [HIDDEN, VOCAB] fp32: 8 MiB (on CPU the attention output meets its first rows)
VOCAB = 2048
EOS = 7               # the end-of-sequence token
MERGE = 2             # the vision encoder's spatial merge size
FLASHINFER_WRAPPERS = 8  # FlashInfer wrappers used in turn (each re-planned only after its last run)
#: The most steps a model is built for (the lesson runs 1000; more is a typo that would take minutes and GiBs).
MAX_STEPS = 10_000

# =============================================================================================
# The model: everything the loops call
# =============================================================================================


class CapstoneModel:
    """The capstone's toy engine on ``stream`` (see the module docstring). Build it inside
    ``with stream:``; ``steps`` is the most steps a loop may run on it."""

    def __init__(self, stream, *, steps: int = 1000, encoder_ms: float = 1.0, decoder_ms: float = 1.0,
                 host_ms: float = 0.3, seed: int = 0, backend: str = "auto", pin_plan_inputs: bool = False):
        if stream is None:
            raise TypeError("stream must be a pinlab stream (pinlab.stream(), pinlab.LaggingStream(), "
                            "pinlab.CudaStream()), got None: build the model inside `with stream:`")
        self.stream = s = cuda_or(stream, "CapstoneModel()")
        self.steps = positive_int("steps", steps, maximum=MAX_STEPS)
        self.encoder_ms = positive_number("encoder_ms", encoder_ms)
        self.decoder_ms = positive_number("decoder_ms", decoder_ms)
        self.host_ms = positive_number("host_ms", host_ms, allow_zero=True)
        if backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'flashinfer', got {backend!r}")
        self.shapes = shapes = SHAPES_EMULATED if s.emulated else SHAPES
        self.setup = d = DecodeSetup(s, steps=self.steps, seed=seed, **shapes)
        self.max_batch = d.max_batch
        self.meta_ints = 2 * d.max_batch + 1       # indptr [max_batch + 1], then last_page_len [max_batch]
        self.eos = EOS
        g = torch.Generator().manual_seed(seed + 1)
        w = torch.randn(HIDDEN, VOCAB, generator=g) / (shapes["num_qo_heads"] * shapes["head_dim"]) ** 0.5
        w[:, EOS] *= 1.6  # a frequent end-of-sequence token: some steps stop a request
        self.lm_head_ref = w                      # the weight's true value (host, for the judge)
        dev = s.device
        self.lm_head = w.to(dev)                  # the GPU copy the LM head matmul reads
        self.meta_dev = torch.zeros(self.steps, self.meta_ints, dtype=torch.int32, device=dev)
        self.tokens_dev = torch.full((self.steps, d.max_batch), -1, dtype=torch.int64, device=dev)
        # the vision encoder: one image per step, its rotary table, a scratch output
        self.rope = l06.VisionRotary(80, device=dev)
        self.grids = [[(1, 16 + 4 * (n % 5), 16 + 4 * ((3 * n) % 7))] for n in range(self.steps)]
        self.vision_out = torch.zeros(2, 40, device=dev)
        self.backend, self.fallback_reason = "torch", None
        self._attn_out = None
        #: hand FlashInfer's plan() pinned host metadata (vLLM 0.33) instead of pageable (vLLM 0.29)
        self.pin_plan_inputs = bool_arg("pin_plan_inputs", pin_plan_inputs)
        self._plan_pinned = None  # the pinned table, made at first use
        self._wrappers, self._plan_done = [], []
        if backend in ("auto", "flashinfer"):
            self._try_flashinfer(backend == "flashinfer")
        else:
            self.fallback_reason = "the torch backend was asked for"
        self.span = _no_span
        self.reset()

    # --- set-up -------------------------------------------------------------------------------
    def _try_flashinfer(self, required: bool) -> None:
        if self.stream.emulated:
            self.fallback_reason = "the emulated stream runs on the CPU; FlashInfer needs CUDA"
        else:
            try:
                d = self.setup
                for _ in range(FLASHINFER_WRAPPERS):
                    w = FlashInferDecode(SHAPES["num_qo_heads"], SHAPES["num_kv_heads"], SHAPES["head_dim"],
                                         SHAPES["page_size"])
                    ip, lpl = d.plan_inputs[0]
                    w.plan(ip, d.indices_cpu[0].to(self.stream.device), lpl)
                    w.run(d.q[0, : d.batch(0)], d.k, d.v)
                    self._wrappers.append(w)
                    self._plan_done.append(None)
                torch.cuda.synchronize()
                self.backend = "flashinfer"
            except FlashInferUnavailableError as exc:
                self._wrappers, self._plan_done = [], []
                self.fallback_reason = str(exc)
        if required and self.backend != "flashinfer":
            raise FlashInferUnavailableError(self.fallback_reason)

    def reset(self) -> None:
        """Forget what an earlier loop delivered (the device rows are overwritten by the next loop)."""
        self.delivered: dict[int, list] = {}
        self.deliveries = 0
        self.stops: list[int] = []
        self.lm_head_host = None
        #: the newest step whose decode() the host has enqueued (-1: none yet); the audit measures a wait's
        #: run-ahead from it
        self.decoded = -1
        #: the steps whose decode() found no restore of the LM head since the previous step's (judged by
        #: :func:`judge`); a restore is an H2D copy into ``m.lm_head`` seen by :class:`LoopAudit`, or a new
        #: tensor assigned to ``m.lm_head``
        self.unrestored: list[int] = []
        self.restored = False
        self._lm_head_seen = self.lm_head
        self.on_decode = None  # called with n at each decode(n) (run_loop's progress bar)

    # --- what the loops call --------------------------------------------------------------------
    def schedule(self, n: int, buf: torch.Tensor) -> None:
        """The scheduler writes step ``n``'s ``indptr`` and ``last_page_len`` into the host buffer ``buf``."""
        with self.span("schedule"):
            d = self.setup
            a = buf.numpy()
            ip, lpl = d.ip_np[n], d.lpl_np[n]
            a[: ip.size] = ip
            a[d.max_batch + 1: d.max_batch + 1 + lpl.size] = lpl

    def encode(self, n: int) -> None:
        """The vision encoder for step ``n``'s image: rotary ids on the device, the gather, then
        ``encoder_ms`` of GPU work (enqueued: returns at once)."""
        with self.span("launch encoder"):
            self.stream.launch(self._encode, n)
            self.stream.busy(self.encoder_ms)

    def _encode(self, n: int) -> None:
        cos, sin = l06.rot_pos_emb(l06.ids_recommended, self.grids[n], MERGE, self.rope)
        self.vision_out[0].copy_(cos.mean(0))
        self.vision_out[1].copy_(sin.mean(0))

    def decode(self, n: int) -> torch.Tensor:
        """Step ``n``'s decode on the GPU (enqueued): page indices from ``meta_dev[n]`` (the device copy
        of the metadata), paged attention, ``decoder_ms`` of GPU work (the decoder's other layers), the
        LM head, argmax. Returns ``tokens_dev[n]`` ([max_batch] int64 on the device, -1 past the batch)."""
        if self.lm_head is not self._lm_head_seen:  # a new GPU buffer: restored by whatever made it
            self._lm_head_seen, self.restored = self.lm_head, True
        if not self.restored:
            self.unrestored.append(int(n))
        self.restored = False
        self.decoded = max(self.decoded, int(n))
        if self.on_decode is not None:
            self.on_decode(n)
        with self.span("launch decode"):
            self.stream.launch(self._decode, n)
            self.stream.busy(self.decoder_ms)
            self.stream.launch(self._lm_head, n)
        return self.tokens_dev[n]

    def _decode(self, n: int) -> None:
        d = self.setup
        b, total = d.batch(n), d.indptrs[n][-1]
        row = self.meta_dev[n]
        ip_dev = safe_indptr(row[: b + 1], total, d.positions[: b + 1])
        idx = page_indices(d.block_table[n, :b], ip_dev, total)
        if self._wrappers:
            k = n % len(self._wrappers)
            if self._plan_done[k] is not None:
                self._plan_done[k].synchronize()  # never re-plan a wrapper whose last plan has not run
            w = self._wrappers[k]
            ip_cpu, lpl_cpu = self.plan_host(n)
            w.plan(ip_cpu, idx, lpl_cpu)
            out = w.run(d.q[n, :b], d.k, d.v)
            ev = torch.cuda.Event()
            ev.record()
            self._plan_done[k] = ev
        else:
            lpl_dev = row[d.max_batch + 1: d.max_batch + 1 + b]
            out = torch_paged_decode(d.q[n, :b], d.k, d.v, ip_dev, idx, lpl_dev, max_pages=d.pages_per_req)
        self._attn_out = out

    def plan_host(self, n: int):
        """Step ``n``'s host ``indptr`` and ``last_page_len`` for FlashInfer's ``plan()``: the setup's
        pageable tensors (vLLM 0.29), or, with :attr:`pin_plan_inputs`, views of one pinned table the
        engine writes once and never rewrites (vLLM 0.33 takes a pinned snapshot per step instead;
        either way ``plan()`` copies pinned memory nobody rewrites)."""
        d = self.setup
        if not self.pin_plan_inputs:
            return d.plan_inputs[n]
        if self._plan_pinned is None:
            table = torch.zeros(self.steps, self.meta_ints, dtype=torch.int32, pin_memory=True)
            a = table.numpy()
            for k in range(self.steps):
                a[k, : d.ip_np[k].size] = d.ip_np[k]
                a[k, d.max_batch + 1: d.max_batch + 1 + d.lpl_np[k].size] = d.lpl_np[k]
            self._plan_pinned = table
        b, row = d.batch(n), self._plan_pinned[n]
        return row[: b + 1], row[d.max_batch + 1: d.max_batch + 1 + b]

    def _lm_head(self, n: int) -> None:
        out, self._attn_out = self._attn_out, None
        o = out.reshape(out.shape[0], -1).float()
        logits = o @ self.lm_head[: o.shape[1]]
        self.tokens_dev[n, : o.shape[0]].copy_(logits.argmax(dim=-1))

    def host_work(self) -> None:
        """The rest of the host's step (the server, the detokenizer): ``host_ms`` of CPU time."""
        with self.span("host work"):
            end = time.perf_counter() + self.host_ms / 1e3
            while time.perf_counter() < end:
                pass

    def emit(self, k: int, host_tokens: torch.Tensor) -> list:
        """Hand step ``k``'s tokens to the detokenizer: ``host_tokens`` (a host tensor) is read *now*."""
        with self.span("emit"):
            if not isinstance(host_tokens, torch.Tensor):
                raise TypeError(f"emit(k, host_tokens): host_tokens must be a host tensor, got {type(host_tokens).__name__}")
            audit = getattr(self.stream, "_audit", None)
            if audit is not None:  # device tokens handed straight over: the .tolist() below waits for the GPU
                audit.read_by_engine(host_tokens, "m.emit(k, <device tokens>) (its .tolist())")
            got = host_tokens.tolist()
            self.deliveries += 1
            self.delivered.setdefault(int(k), got)
            return got

    def note_stop(self, k: int) -> None:
        """Record that a request of step ``k`` produced the end-of-sequence token."""
        self.stops.append(int(k))


class _NoSpan:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _no_span(name):
    return _NoSpan()


# =============================================================================================
# The two loops (notebook 07 defines planted_loop in a cell, solutions/07 both; tests/test_l07.py checks they match)
# =============================================================================================


def planted_loop(m, steps):
    """The capstone's inference loop as written: it runs, and it is wrong in five places."""
    s = m.stream
    m.lm_head_host = m.lm_head.to("cpu")                      # offload the LM head to host memory
    meta = torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True)  # the metadata buffer
    tokens_host = torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True)
    m.schedule(0, meta)                                       # the scheduler writes step 0's metadata
    for n in range(steps):
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)    # restore the offloaded LM head (8 MiB)
        m.encode(n)                                           # vision encoder: rotary ids, GPU work
        snap = meta.pin_memory()                              # a private snapshot of step n's metadata
        m.meta_dev[n].copy_(snap, non_blocking=True)          # H2D: indptr + last_page_len
        if n + 1 < steps:
            m.schedule(n + 1, meta)                           # the scheduler moves on to step n+1
        tokens = m.decode(n)                                  # paged attention, LM head, argmax (GPU)
        tokens_host.copy_(tokens, non_blocking=True)          # D2H into pinned memory
        m.emit(n, tokens_host)                                # hand step n's tokens to the detokenizer
        if tokens.eq(m.eos).any().item():                     # did a request finish?
            m.note_stop(n)
        m.host_work()                                         # the server, the detokenizer (CPU)
    s.synchronize()


def fixed_loop(m, steps, depth=4):
    """The same loop, fixed: honest copies, a ring of pinned buffers guarded by events, no sync."""
    s = m.stream
    m.lm_head_host = torch.empty_like(m.lm_head, device="cpu", pin_memory=True).copy_(m.lm_head)
    meta = [torch.zeros(m.meta_ints, dtype=torch.int32, pin_memory=True) for _ in range(depth)]
    tokens_host = [torch.zeros(m.max_batch, dtype=torch.int64, pin_memory=True) for _ in range(depth)]
    done = [None] * depth                                     # done[i]: recorded after the last step of slot i

    def deliver(k):                                           # step k's tokens, once its copies have run
        done[k % depth].synchronize()
        if m.eos in m.emit(k, tokens_host[k % depth]):
            m.note_stop(k)

    m.schedule(0, meta[0])
    for n in range(steps):
        i = n % depth
        m.lm_head.copy_(m.lm_head_host, non_blocking=True)    # pinned source: a truly async copy
        m.encode(n)
        m.meta_dev[n].copy_(meta[i], non_blocking=True)       # slot i is rewritten only after its event
        tokens = m.decode(n)
        tokens_host[i].copy_(tokens, non_blocking=True)
        done[i] = s.Event()
        done[i].record()
        if n + 1 >= depth:
            deliver(n + 1 - depth)                            # frees slot (n + 1) % depth
        if n + 1 < steps:
            m.schedule(n + 1, meta[(n + 1) % depth])
        m.host_work()
    for k in range(max(0, steps - depth + 1), steps):
        deliver(k)
    s.synchronize()


# =============================================================================================
# The audit: what the loop's own lines do
# =============================================================================================

PAGEABLE = "pageable non_blocking H2D"
BLOCKING = "blocking copy"
SYNC = "host sync"
PIN_NOOP = "pin_memory() of a pinned tensor"
#: a wait (``event.synchronize()``, or ``event.query()`` polled) inside the loop on an event recorded after
#: the newest step the host had enqueued: no later step was queued behind it, the host ran 0 steps ahead
FULL_WAIT = "wait on the newest step's event"
AUDIT_KINDS = (PAGEABLE, BLOCKING, SYNC, PIN_NOOP, FULL_WAIT)
#: torch calls that give the host a value computed on the device (or a result whose size the device
#: computes): each waits for the GPU. ``x in t`` (``Tensor.__contains__``: ``(x == t).any().item()``, torch/_tensor.py)
#: and ``torch.equal``/``allclose`` answer a Python bool.
_SYNC_NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "nonzero", "numpy",
               "cpu", "__format__", "__repr__", "__array__", "argwhere", "unique", "unique_consecutive", "bincount",
               "masked_select", "__contains__", "equal", "allclose", "is_nonzero"}
#: how a sync call is named in the audit (default: ``.name()``)
_SYNC_CALLS = {"__contains__": "x in tensor (Tensor.__contains__)", "__bool__": "bool() or if of a tensor (Tensor.__bool__)",
               "__int__": "int(tensor)", "__float__": "float(tensor)", "__index__": "a tensor used as an index (__index__)",
               "__complex__": "complex(tensor)", "__format__": "f-string / format() of a tensor",
               "__repr__": "print() / repr() of a tensor", "__array__": "numpy.asarray(tensor)",
               "equal": "torch.equal()", "allclose": "torch.allclose()"}


_TORCH_DIRS = tuple({os.path.dirname(torch.__file__) + os.sep, os.path.realpath(os.path.dirname(torch.__file__)) + os.sep})


def _codes(code):
    """A code object and the code objects nested in it (a loop's inner functions)."""
    yield code
    for c in code.co_consts:
        if hasattr(c, "co_lines"):
            yield from _codes(c)




class LoopAudit(TorchFunctionMode):
    """Record what ``fn``'s own lines do on ``stream``: pageable ``non_blocking`` H2D copies, blocking
    copies, host syncs (``.item()``, ``.tolist()``, ``bool()``, ``nonzero``... of device tensors) and
    ``pin_memory()`` of a pinned tensor. Works on CUDA and on the emulated lagging stream. Enter it
    *inside* ``with stream:``. ``events``: ``{(kind, call, line, nbytes): count}``, ``line`` counted
    from ``def`` (line 1) of ``fn``.

    Given the ``model`` the loop runs on and its ``steps``, it also tells the model of every H2D copy
    into ``model.lm_head`` (a restore, :attr:`CapstoneModel.unrestored`) and, for events made by
    :meth:`event_class` (:func:`run_loop` makes every event of the loop one), records as
    :data:`FULL_WAIT` each wait, from step 0's decode until the last step's, on an event recorded after
    the newest step the host had enqueued (its run-ahead: how many steps the host had enqueued after
    the event; 0 leaves the GPU nothing queued behind it)."""

    def __init__(self, stream, fn, *, model=None, steps: int | None = None):
        super().__init__()
        callable_arg("fn", fn)
        if model is not None:
            _model_arg(model)
        self.model = model
        self.steps = positive_int("steps", steps) if steps is not None else (model.steps if model else 0)
        self.s = stream
        code = getattr(fn, "__code__", None)
        self.file = code.co_filename if code else None
        self.first = code.co_firstlineno if code else 0
        self.last = max((ln for c in _codes(code) for _, _, ln in c.co_lines() if ln), default=0) if code else 0
        self.name = getattr(fn, "__name__", "the loop")
        self.events: dict = {}
        #: the events seen at least once inside the loop: after step 0's decode was enqueued and before the
        #: last step's (with a model; without one, nothing is known to be inside)
        self.inside: set = set()
        self._saved_cuda_sync = None

    def _dev(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return self.s.is_device(t) if self.s.emulated else t.device.type == "cuda"

    def _pinned(self, t) -> bool:
        return self.s.is_pinned(t) if self.s.emulated else bool(t.is_pinned())

    def _where(self):
        """The line (from ``def``, 1-based) of the loop that made the current torch call itself, or
        None when the call came from elsewhere (the model's plumbing, FlashInfer, torch)."""
        f = sys._getframe(1)
        while f is not None and (f.f_code in _OWN_CODE or f.f_code.co_filename.startswith(_TORCH_DIRS)):
            f = f.f_back
        if f is None or f.f_code.co_filename != self.file or not self.first <= f.f_lineno <= self.last:
            return None
        return f.f_lineno - self.first + 1

    def _caller_line(self):
        """The line of the loop (from ``def``, 1-based) the current call came from, directly or through the
        functions it called (a wrapper such as ``lambda m, steps: fixed_loop(m, steps, depth=1)`` is the
        loop then), or None when it came from the model's own plumbing or from outside the loop."""
        return self._loop_line(sys._getframe(1))

    def _loop_line(self, f):
        """:meth:`_caller_line` from frame ``f`` outwards."""
        while f is not None:
            if f.f_code in _MODEL_CODE:
                return None  # the engine's own waits (FlashInfer's plan events) are not the loop's
            if (f.f_code not in _OWN_CODE and f.f_code.co_filename == self.file
                    and self.first <= f.f_lineno <= self.last):
                return f.f_lineno - self.first + 1
            f = f.f_back
        return None

    def in_loop(self) -> bool:
        """The host is inside the loop: step 0's decode is enqueued, the last step's is not yet. Before it is
        set-up (offloading the LM head), after it draining (the last deliveries, the final synchronize)."""
        m = self.model
        return m is not None and 0 <= m.decoded < self.steps - 1

    def _note(self, kind, call, nbytes, line=None):
        line = self._where() if line is None else line
        if line is None:
            return
        key = (kind, call, line, int(nbytes))
        self.events[key] = self.events.get(key, 0) + 1
        if self.in_loop():
            self.inside.add(key)

    def read_by_engine(self, t, call: str) -> None:
        """The engine (``m.emit``) reads ``t`` on the host now, handed to it by the loop: a device tensor is a
        host sync of the loop's line that handed it over (the engine's ``.tolist()`` waits for the GPU)."""
        if not self._dev(t):
            return
        f = sys._getframe(2)  # the caller of the engine's method
        line = self._loop_line(f)
        if line is not None:
            self._note(SYNC, call, t.numel() * t.element_size(), line)

    def cuda_synchronize(self, device=None) -> None:
        """``torch.cuda.synchronize()`` while the loop runs: a host sync of the loop's line, then the wait."""
        self._note(SYNC, "torch.cuda.synchronize()", 0)
        return self._saved_cuda_sync(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        watch = not (self.s.emulated and self.s._draining)
        if watch:
            try:
                self._inspect(name, args, kwargs)
            except Exception:  # unusual arguments: let torch (and the stream) deal with them
                pass
        out = func(*args, **kwargs)
        if watch and name in ("to", "cuda"):
            try:
                self._inspect_to(name, args, kwargs, out)
            except Exception:
                pass
        return out

    def _inspect(self, name, args, kwargs):
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor):
            return
        nbytes = first.numel() * first.element_size()
        if name == "pin_memory":
            if not self._dev(first) and self._pinned(first):
                self._note(PIN_NOOP, ".pin_memory()", nbytes)
            return
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = first, args[1]
            nb = copy_call(name, args, kwargs).non_blocking
            if self._dev(dst) and not self._dev(src):
                size = src.numel() * src.element_size()
                lm = self.model.lm_head if self.model is not None else None
                if lm is not None and dst.numel() == lm.numel() and _same_storage(dst, lm):
                    self.model.restored = True  # step n's LM head restored before its decode
                if not nb:
                    self._note(BLOCKING, ".copy_() host to device", size)
                elif not self._pinned(src):
                    self._note(PAGEABLE, ".copy_(..., non_blocking=True)", size)
            elif self._dev(src) and not self._dev(dst):
                if not nb or not self._pinned(dst):
                    self._note(BLOCKING, ".copy_() device to host", src.numel() * src.element_size())
            return
        if name == "__setitem__" and len(args) >= 3 and isinstance(args[2], torch.Tensor):
            dst, src = first, args[2]
            if self._dev(dst) and not self._dev(src):  # gpu[...] = host tensor: a blocking H2D copy
                self._note(BLOCKING, "[...] = host tensor", src.numel() * src.element_size())
                lm = self.model.lm_head if self.model is not None else None
                if lm is not None and dst.numel() == lm.numel() and _same_storage(dst, lm):
                    self.model.restored = True
            return
        if name in ("to", "cuda"):
            return  # judged by where its result is (_inspect_to)
        if name in _SYNC_NAMES and (self._dev(first) or (name in ("equal", "allclose") and len(args) > 1
                                                         and self._dev(args[1]))):
            self._note(SYNC, _SYNC_CALLS.get(name, f".{name}()"), nbytes)
        elif name == "__getitem__" and self._dev(first) and len(args) > 1 and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() > 0
                for t in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self._note(SYNC, "[boolean mask]", nbytes)  # the result's size is known only after the kernel ran
        elif name == "repeat_interleave" and self._dev(first) and kwargs.get("output_size") is None \
                and len(args) < 4:
            reps = kwargs.get("repeats", args[1] if len(args) > 1 else first)
            if isinstance(reps, torch.Tensor) and self._dev(reps):
                self._note(SYNC, ".repeat_interleave() without output_size", nbytes)

    def _inspect_to(self, name, args, kwargs, out):
        """``t.to(...)`` / ``t.cuda(...)``, judged by where the stream put the result (host memory made device
        memory: an H2D copy; the reverse: a D2H one), ``non_blocking`` read by :func:`pinlab.copyargs.copy_call`
        in every form torch accepts (``to(device, dtype, True)``, ``to(other, True)``, ``cuda(device, True)``)."""
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        nb = copy_call(name, args, kwargs).non_blocking
        nbytes = first.numel() * first.element_size()
        if self._dev(out) and not self._dev(first):
            if not nb:
                self._note(BLOCKING, f".{name}() host to device", nbytes)
            elif not self._pinned(first):
                self._note(PAGEABLE, f".{name}(..., non_blocking=True)", nbytes)
        elif self._dev(first) and not self._dev(out) and not nb:
            self._note(SYNC, ".to('cpu')", nbytes)  # into pageable memory: it waits (non_blocking: pinned, no wait)

    def event_class(self, base):
        """A subclass of the event class ``base`` (``torch.cuda.Event``, or the emulated stream's) whose
        ``record()`` notes the newest step enqueued, and whose ``synchronize()`` and repeated
        ``query()`` (a poll: queried again, False, with no step enqueued in between) note a
        :data:`FULL_WAIT` where the host had enqueued no step after the event."""
        return type(base.__name__, (base,), {"record": _ev_record, "synchronize": _ev_synchronize, "query": _ev_query,
                                            "_pinlab_base": base, "_pinlab_audit": self, "_pinlab_step": None,
                                            "_pinlab_poll": None, "__doc__": base.__doc__})

    def _wait(self, recorded, call: str) -> None:
        """The loop waits on an event recorded when step ``recorded`` was the newest one enqueued."""
        m = self.model
        if m is None or recorded is None:
            return
        if 0 <= m.decoded < self.steps - 1 and m.decoded - recorded < 1:  # set-up and draining may wait
            line = self._caller_line()
            if line is not None:
                self._note(FULL_WAIT, call, 0, line)

    def count(self, kind=None, *, more_than: int = 0) -> int:
        return sum(c for (k, *_), c in self.events.items() if (kind is None or k == kind) and c > more_than)

    def lines(self) -> list[str]:
        """One line per (kind, call, line), most frequent first: what a reader of the loop needs."""
        out = []
        for (kind, call, line, nbytes), c in sorted(self.events.items(), key=lambda kv: (-kv[1], kv[0][2])):
            size = f", {fmt_bytes(nbytes)}" if nbytes else ""
            out.append(f"{kind}: {call} at line {line} of {self.name}{size}, {c} time(s)")
        return out

    def count_in_loop(self, kind=None) -> int:
        """The events of ``kind`` (None: all) of the lines seen at least once inside the loop (:meth:`in_loop`),
        each counted whole; without a model, those seen more than :data:`IN_LOOP` times."""
        if self.model is None:
            return self.count(kind, more_than=IN_LOOP)
        return sum(c for key, c in self.events.items() if (kind is None or key[0] == kind) and key in self.inside)

    def as_list(self) -> list[dict]:
        """One dict per (kind, call, line, nbytes): ``count``, and ``in_loop`` (seen inside the loop at least once)."""
        return [{"kind": k, "call": call, "line": line, "nbytes": nb, "count": c,
                 "in_loop": (k, call, line, nb) in self.inside if self.model is not None else c > IN_LOOP}
                for (k, call, line, nb), c in sorted(self.events.items(), key=lambda kv: (kv[0][2], kv[0][0]))]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _ev_record(self, *args, **kwargs):
    out = self._pinlab_base.record(self, *args, **kwargs)
    m = self._pinlab_audit.model
    self._pinlab_step = m.decoded if m is not None else None
    self._pinlab_poll = None
    return out


def _ev_synchronize(self):
    self._pinlab_audit._wait(self._pinlab_step, "event.synchronize()")
    return self._pinlab_base.synchronize(self)


def _ev_query(self):
    done = self._pinlab_base.query(self)
    m = self._pinlab_audit.model
    if done or m is None:
        self._pinlab_poll = None
    elif self._pinlab_poll == ("polled", m.decoded):
        pass  # this poll's wait is noted once
    elif self._pinlab_poll == m.decoded:  # queried again, no step enqueued in between: the host polls
        self._pinlab_poll = ("polled", m.decoded)
        self._pinlab_audit._wait(self._pinlab_step, "event.query() polled")
    else:
        self._pinlab_poll = m.decoded
    return done


class _WatchedStream:
    """``m.stream`` while a loop runs under :func:`run_loop`: the stream itself, except that
    ``synchronize()`` is recorded as a host sync at the loop's line (it is no torch call), and
    ``Event()`` makes an event the audit watches (``torch.cuda.Event`` is that class meanwhile)."""

    def __init__(self, stream, audit: LoopAudit):
        self._stream, self._audit = stream, audit

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def synchronize(self) -> None:
        self._audit._note(SYNC, "stream.synchronize()", 0)
        self._stream.synchronize()

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


_OWN_CODE = {LoopAudit._where.__code__, LoopAudit._note.__code__, LoopAudit._inspect.__code__,
             LoopAudit._inspect_to.__code__, LoopAudit.__torch_function__.__code__, LoopAudit._wait.__code__,
             _WatchedStream.synchronize.__code__, _ev_synchronize.__code__, _ev_query.__code__,
             LoopAudit._caller_line.__code__, LoopAudit._loop_line.__code__, LoopAudit.read_by_engine.__code__,
             LoopAudit.cuda_synchronize.__code__}
_MODEL_CODE = {f.__code__ for f in vars(CapstoneModel).values() if hasattr(f, "__code__")}

#: Without a model (a bare :class:`LoopAudit`), a sync or blocking copy seen more often than this is taken
#: for one inside the loop (once per step). With one (:func:`run_loop`), what ran inside the loop is known
#: exactly (:meth:`LoopAudit.in_loop`: between step 0's decode and the last step's), on CUDA as on the
#: emulated stream: no count is tolerated.
IN_LOOP = 8


# =============================================================================================
# The harness and the judge
# =============================================================================================


def _model_arg(m) -> None:
    if not isinstance(m, CapstoneModel):
        raise TypeError(f"m must be a CapstoneModel (l07.CapstoneModel(stream, steps=...)), got {type(m).__name__}")


def judge(m: CapstoneModel, steps: int, rows: list, tokens: list, lm_head_ok: bool) -> dict:
    """Exact verdicts for a loop of ``steps`` steps on ``m``: ``rows`` and ``tokens`` are the final
    device rows (metadata each copy delivered) and tokens the GPU computed, as lists."""
    _model_arg(m)
    steps = positive_int("steps", steps, maximum=m.steps)
    for name, value, width in (("rows", rows, m.meta_ints), ("tokens", tokens, m.max_batch)):
        if not isinstance(value, (list, tuple)) or len(value) < steps:
            raise ValueError(f"{name} must be a list of at least steps={steps} rows, got "
                             f"{len(value) if isinstance(value, (list, tuple)) else type(value).__name__}")
        for n in range(steps):
            if not isinstance(value[n], (list, tuple)) or len(value[n]) != width:
                raise ValueError(f"{name}[{n}] must be a list of {width} ints, got {value[n]!r}"[:200])
    d = m.setup
    received = [match_received(rows[n], d.images, n, d.batch(n), d.max_batch) for n in range(steps)]
    wrong_meta = [n for n in range(steps) if received[n] != n]
    missing = [n for n in range(steps) if n not in m.delivered]
    stale = [n for n in range(steps) if n in m.delivered and m.delivered[n] != tokens[n]]
    extra = sorted(k for k in m.delivered if not 0 <= k < steps)
    want_stops = [n for n in range(steps) if EOS in tokens[n][: d.batch(n)]]
    corrupted = sorted(set(wrong_meta) | set(stale) | set(missing))
    first_stale = stale[0] if stale else None
    # a stale read got a later step's tokens (its slot was overwritten before it was read), or not (it was
    # read before its own copy had run: an earlier step's tokens, or the slot's first zeros)
    steps_of: dict[tuple, list[int]] = {}
    for n in range(steps):
        steps_of.setdefault(tuple(tokens[n]), []).append(n)
    overwritten_by = {}
    for n in stale:
        same = steps_of.get(tuple(m.delivered[n]), [])
        if same and same[0] > n:
            overwritten_by[n] = same[0]
    unrestored = [n for n in m.unrestored if 0 <= n < steps]
    return {
        "steps": steps,
        "received": received,
        "wrong_meta": len(wrong_meta),
        "first_wrong_meta": wrong_meta[0] if wrong_meta else None,
        "stale_reads": len(stale),
        "first_stale": first_stale,
        "first_stale_got": m.delivered[first_stale] if stale else None,
        "first_stale_want": tokens[first_stale] if stale else None,
        "overwritten": len(overwritten_by),
        "first_stale_overwritten_by": overwritten_by.get(first_stale),
        "missing": len(missing),
        "first_missing": missing[0] if missing else None,
        "extra": extra,
        "deliveries": m.deliveries,
        "stops": sorted(m.stops),
        "want_stops": want_stops,
        "stops_ok": sorted(m.stops) == want_stops,
        "lm_head_ok": bool(lm_head_ok),
        "unrestored": len(unrestored),
        "first_unrestored": unrestored[0] if unrestored else None,
        "corrupted": len(corrupted),
    }


def run_loop(m: CapstoneModel, loop, steps: int, *, progress: str | None = None) -> dict:
    """Run ``loop(m, steps)`` on ``m.stream`` under :class:`LoopAudit`, then judge it. Returns the
    judge's verdicts plus ``audit`` (events), ``audit_lines``, ``counts`` per kind, ``seconds``.
    ``progress``: a label for a progress bar on stderr, one tick per step decoded (None: none)."""
    _model_arg(m)
    callable_arg("loop", loop)
    steps = positive_int("steps", steps)
    if steps > m.steps:
        raise ValueError(f"steps ({steps}) must be <= the model's steps ({m.steps})")
    bar = None
    if progress is not None:
        from ..progress import progress as progress_bar

        bar = progress_bar(range(steps), progress)
    s = m.stream
    threads = torch.get_num_threads()
    if s.emulated:
        # the emulated GPU's kernels are tiny: on one thread they run 10x faster than on torch's intra-op
        # threads, which spin-wait for each other on a CPU shared with other jobs (1000 steps: 10 s, not 90)
        torch.set_num_threads(1)
    try:
        return _run_loop(m, s, loop, steps, bar)
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()


def _run_loop(m: CapstoneModel, s, loop, steps: int, bar) -> dict:
    with s:
        m.meta_dev.zero_()
        m.tokens_dev.fill_(-1)
        m.lm_head.copy_(m.lm_head_ref.to(s.device))
        s.synchronize()
        m.reset()
        audit = LoopAudit(s, loop, model=m, steps=steps)
        t0 = time.perf_counter()
        m.stream = _WatchedStream(s, audit)
        cuda_event = torch.cuda.Event
        torch.cuda.Event = audit.event_class(cuda_event)  # the loop's events (its own too) are watched
        if bar is not None:
            m.on_decode = lambda n: bar.update(1)
        try:
            # under the audit (the emulated stream refuses what CUDA refuses and makes torch.cuda.synchronize()
            # its wait: streams.py); torch.cuda.synchronize() is a sync
            with audit:
                audit._saved_cuda_sync, torch.cuda.synchronize = torch.cuda.synchronize, audit.cuda_synchronize
                try:
                    loop(m, steps)
                finally:
                    torch.cuda.synchronize, audit._saved_cuda_sync = audit._saved_cuda_sync, None
        finally:
            m.stream = s
            torch.cuda.Event = cuda_event
            m.on_decode = None
        s.synchronize()
        seconds = time.perf_counter() - t0
        rows = m.meta_dev[:steps].cpu().tolist()
        tokens = m.tokens_dev[:steps].cpu().tolist()
        lm_ok = torch.equal(m.lm_head.cpu(), m.lm_head_ref)
    out = judge(m, steps, rows, tokens, lm_ok)
    out["audit"] = audit.as_list()
    out["audit_lines"] = audit.lines()
    out["counts"] = {k: audit.count(k) for k in AUDIT_KINDS}
    out["in_loop"] = {k: audit.count_in_loop(k) for k in AUDIT_KINDS}
    out["seconds"] = seconds
    return out


def model_args(*, steps, encoder_ms, decoder_ms, host_ms, seed=0, backend="auto") -> dict:
    return dict(steps=positive_int("steps", steps, maximum=MAX_STEPS), encoder_ms=positive_number("encoder_ms", encoder_ms),
                decoder_ms=positive_number("decoder_ms", decoder_ms),
                host_ms=positive_number("host_ms", host_ms, allow_zero=True),
                seed=positive_int("seed", seed, allow_zero=True), backend=backend)


# =============================================================================================
# GPU experiments (the notebook hands its loops to these through pinlab.measure)
# =============================================================================================


def _loops_arg(loops) -> dict:
    if not isinstance(loops, dict) or not loops:
        raise TypeError("loops must be a non-empty dict {name: loop(m, steps)}")
    for k, fn in loops.items():
        callable_arg(f"loops[{k!r}]", fn)
    return loops


def _short(r: dict) -> dict:
    r = dict(r)
    r.pop("received", None)
    return r


def _pinned_plan_arg(pinned_plan, loops: dict) -> frozenset:
    """``pinned_plan``: the names of the loops whose runs hand FlashInfer's ``plan()`` pinned host
    metadata (:attr:`CapstoneModel.pin_plan_inputs`); every other loop's runs hand it pageable tensors."""
    if isinstance(pinned_plan, (str, bytes)) or not isinstance(pinned_plan, (list, tuple, set, frozenset)):
        raise TypeError(f"pinned_plan must be a list of loop names such as ['fixed'], got {type(pinned_plan).__name__}")
    unknown = [n for n in pinned_plan if n not in loops]
    if unknown:
        raise ValueError(f"pinned_plan names loops that are not in loops: {unknown[:3]} (loops: {list(loops)})")
    return frozenset(pinned_plan)


class _SpanClock:
    """``m.span`` for a timed run without the profiler: adds up the host ms spent inside each named
    span (the engine's calls: schedule, launches, host work, emit), a few µs per span."""

    def __init__(self):
        self.ms: dict[str, float] = {}

    def __call__(self, name):
        return _ClockSpan(self, name)


class _ClockSpan:
    __slots__ = ("clock", "name", "t0")

    def __init__(self, clock, name):
        self.clock, self.name, self.t0 = clock, name, 0.0

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        ms = self.clock.ms
        ms[self.name] = ms.get(self.name, 0.0) + (time.perf_counter() - self.t0) * 1e3
        return False


def span_union_ms(spans) -> float:
    """Milliseconds covered by at least one of ``spans`` (``[start, end, ...]``, ms): overlapping
    spans count once (a GPU lane's kernels and copies, a host lane's calls)."""
    if isinstance(spans, (str, bytes)) or not hasattr(spans, "__iter__"):
        raise TypeError(f"spans must be a list of [start, end, label] spans, got {type(spans).__name__}")
    total, end = 0.0, None
    for a, b in sorted((float(sp[0]), float(sp[1])) for sp in spans):
        if b < a:
            raise ValueError(f"a span ends before it starts ({a} > {b})")
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def audit(loops, *, steps: int = 200, encoder_ms: float = 1.0,
          decoder_ms: float = 1.0, host_ms: float = 0.3, seed: int = 0,
          backend: str = "auto", stream=None) -> dict:
    """Each loop of ``loops`` once through :func:`run_loop` (audit and judge) on the CUDA stream
    (``stream=None``) or the given stream. Returns ``{"backend", "fallback_reason", "loops": {name:
    verdicts}}`` (``received`` per step dropped)."""
    loops = _loops_arg(loops)
    s = cuda_or(stream, "audit()")
    with s:
        m = CapstoneModel(s, **model_args(steps=steps, encoder_ms=encoder_ms, decoder_ms=decoder_ms,
                                      host_ms=host_ms, seed=seed,
                                          backend=backend))
    out = {name: _short(run_loop(m, fn, steps)) for name, fn in loops.items()}
    res = {"backend": m.backend, "fallback_reason": m.fallback_reason, "loops": out}
    del m
    gc.collect()
    return res


def throughput(loops, *, steps: int = 150, rounds: int = 3, warm_steps: int = 10, encoder_ms: float = 1.0,
               decoder_ms: float = 1.0, host_ms: float = 0.3, seed: int = 0, backend: str = "auto",
               pinned_plan=()) -> dict:
    """Steps per second of each loop (CUDA): a warm-up, then ``rounds`` interleaved rounds of
    ``steps`` steps each; the median round per loop. Also, in that round, the host ms per step spent
    in the engine's calls (schedule, launches, host work, emit; timed without the profiler), in all
    and per call. Loops named in ``pinned_plan`` hand FlashInfer's ``plan()`` pinned inputs.
    Returns ``{"backend", "loops": {name: {"steps_per_s", "ms_per_step", "rounds_ms",
    "host_ms_per_step", "host_spans_ms"}}}``."""
    loops = _loops_arg(loops)
    pinned = _pinned_plan_arg(pinned_plan, loops)
    rounds = positive_int("rounds", rounds)
    warm_steps = positive_int("warm_steps", warm_steps)
    require_cuda("throughput()")
    from ..streams import CudaStream

    s = CudaStream()
    m = CapstoneModel(s, **model_args(steps=steps, encoder_ms=encoder_ms, decoder_ms=decoder_ms,
                                      host_ms=host_ms, seed=seed,
                                      backend=backend))
    for name, fn in loops.items():
        m.reset()
        m.pin_plan_inputs = name in pinned
        fn(m, min(warm_steps, steps))
        torch.cuda.synchronize()

    def one_round(name, _r):
        m.reset()
        m.pin_plan_inputs = name in pinned
        clock = m.span = _SpanClock()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            loops[name](m, steps)
            torch.cuda.synchronize()
        finally:
            m.span = _no_span
        return (time.perf_counter() - t0) * 1e3, {k: v / steps for k, v in clock.ms.items()}

    # the order rotates each round, so that a slow spell of the machine falls on every loop, not on one
    runs = interleaved(list(loops), rounds, one_round)
    per = {name: [ms for ms, _ in got] for name, got in runs.items()}
    spans = {name: [sp for _, sp in got] for name, got in runs.items()}
    res = {"backend": m.backend, "loops": {}}
    for name, ms in per.items():
        i = sorted(range(len(ms)), key=ms.__getitem__)[len(ms) // 2]  # the median round
        res["loops"][name] = {"steps_per_s": steps / (ms[i] / 1e3), "ms_per_step": ms[i] / steps,
                              "rounds_ms": [round(x, 3) for x in ms],
                              "host_ms_per_step": sum(spans[name][i].values()), "host_spans_ms": spans[name][i]}
    del m
    gc.collect()
    torch.cuda.synchronize()
    return res


TRACE = "build/traces/07_capstone.json"


def timeline(loops, *, steps: int = 6, encoder_ms: float = 1.0,
          decoder_ms: float = 1.0, host_ms: float = 0.3, seed: int = 0,
             backend: str = "auto", trace: str = TRACE, pinned_plan=()) -> dict:
    """A few steps of each loop under ``torch.profiler`` (CUDA): host spans (schedule, launches, host
    work, emit) and GPU spans (kernels, memcpys), per loop (:func:`pinlab.profiler.profile_runs`).
    Loops named in ``pinned_plan`` hand FlashInfer's ``plan()`` pinned inputs. ``gpu_idle_share`` is
    None where the trace holds no GPU span (a profiler that records no GPU activity)."""
    from ..profiler import gpu_kernel_idle_share, profile_runs

    loops = _loops_arg(loops)
    pinned = _pinned_plan_arg(pinned_plan, loops)
    require_cuda("timeline()")
    from ..streams import CudaStream

    s = CudaStream()
    m = CapstoneModel(s, **model_args(steps=steps, encoder_ms=encoder_ms, decoder_ms=decoder_ms,
                                      host_ms=host_ms, seed=seed,
                                      backend=backend))

    def runner(name, fn):
        def run(span):
            m.reset()
            m.pin_plan_inputs = name in pinned
            m.span = span
            try:
                fn(m, steps)
            finally:
                m.span = _no_span
            torch.cuda.synchronize()
        return run

    spans, spans_from = profile_runs({f"run: {name}": runner(name, fn) for name, fn in loops.items()}, trace)
    res = {"backend": m.backend, "spans_from": spans_from, "loops": {}}
    for name in loops:
        r = spans[f"run: {name}"]
        res["loops"][name] = {"window_ms": r["window_ms"], "host": r["host"], "gpu": r["gpu"],
                              "memcpy_names": r["memcpy_names"], "gpu_idle_share": gpu_kernel_idle_share(r)}
    del m
    gc.collect()
    torch.cuda.synchronize()
    return res


def emulated(loops, *, steps: int = 200, seed: int = 0) -> dict:
    """Each loop through :func:`run_loop` on a new emulated :class:`pinlab.LaggingStream` (the
    order is exact, the timing says nothing). Same schema as :func:`audit`."""
    from ..streams import LaggingStream

    loops = _loops_arg(loops)
    s = LaggingStream()
    with s:
        m = CapstoneModel(s, **model_args(steps=steps, encoder_ms=1.0, decoder_ms=1.0, host_ms=0.0, seed=seed,
                                          backend="auto"))
    return {"backend": m.backend, "fallback_reason": m.fallback_reason,
            "loops": {name: _short(run_loop(m, fn, steps)) for name, fn in loops.items()}}


def plot_timelines(result: dict, *, title: str, names=None):
    """One host-vs-GPU timeline per loop of a :func:`timeline` result, on a shared time axis, stacked at a page's
    width (``plots.MAX_WIDTH_IN``), the legend under each."""
    from ..plots import MAX_WIDTH_IN, subplots
    from ..plots import timeline as draw

    names = list(names or result["loops"])
    fig, axes = subplots(len(names), 1, figsize=(MAX_WIDTH_IN, 2.4 * len(names)), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    for ax, name in zip(axes, names):
        r = result["loops"][name]
        draw({"host": r["host"], "GPU": r["gpu"]}, title=f"{name}: {title}", ax=ax)
    return fig


def stall_lines(report, fn) -> list[str]:
    """The places of a :func:`pinlab.detect_stalls` report that lie in ``fn`` (a loop), as
    ``"kind: op at line N of fn, M time(s)"`` (N counted from ``def``, line 1), most frequent first:
    the same text on every machine (the file a notebook cell runs from has a temporary name)."""
    callable_arg("fn", fn)
    code = fn.__code__
    last = max((ln for c in _codes(code) for _, _, ln in c.co_lines() if ln), default=code.co_firstlineno)
    rows = []
    for (kind, op, where), count in report.places.items():
        file, _, line = where.rpartition(":")
        if file == code.co_filename and line.isdigit() and code.co_firstlineno <= int(line) <= last:
            rows.append((-count, int(line) - code.co_firstlineno + 1, kind, op))
    return [f"{kind}: {op} at line {line} of {fn.__name__}, {-c} time(s)" for c, line, kind, op in sorted(rows)]


def code_of_lines(lines, fn) -> list[str]:
    """``lines`` (:func:`stall_lines` or :class:`LoopAudit` lines: ``"... at line N of name ..."``) with each
    line number of ``fn`` replaced by that line's code (its comment dropped): ``"... at `code` in name ..."``,
    for a reader who sees the code without line numbers. A line is left as it is where ``fn``'s source
    cannot be read or has no such line."""
    callable_arg("fn", fn)
    if isinstance(lines, (str, bytes)) or not hasattr(lines, "__iter__"):
        raise TypeError(f"lines must be a list of str, got {type(lines).__name__}")
    name = getattr(fn, "__name__", "")

    def code(mo):
        text = line_code(fn, int(mo.group(1))) if mo.group(2) == name else None
        return f"at `{text}` in {name}" if text else mo.group(0)

    return [re.sub(r"at line (\d+) of (\w+)", code, str(x)) for x in lines]


def line_code(fn, line: int) -> str | None:
    """The code of line ``line`` of ``fn`` (counted from ``def``, line 1), its comment dropped; None where
    the source cannot be read (a function compiled from a string) or has no such line."""
    try:
        src = textwrap.dedent(inspect.getsource(fn)).splitlines()
    except (OSError, TypeError):
        return None
    if not isinstance(line, int) or not 1 <= line <= len(src):
        return None
    return re.sub(r"\s+#.*$", "", src[line - 1]).strip() or None


def elsewhere_lines(report, fn) -> list[str]:
    """The places of a :func:`pinlab.detect_stalls` report that do **not** lie in ``fn``'s own lines (what
    FlashInfer or another library called), grouped by file: ``"kind: op in pkg/file.py, M time(s)"``
    (the file's last two path parts), most frequent first."""
    callable_arg("fn", fn)
    code = fn.__code__
    last = max((ln for c in _codes(code) for _, _, ln in c.co_lines() if ln), default=code.co_firstlineno)
    rows: dict = {}
    for (kind, op, where), count in report.places.items():
        file, _, line = where.rpartition(":")
        if file == code.co_filename and line.isdigit() and code.co_firstlineno <= int(line) <= last:
            continue
        short = "/".join(os.path.normpath(file or where).split(os.sep)[-2:])
        rows[(kind, op, short)] = rows.get((kind, op, short), 0) + count
    return [f"{kind}: {op} in {short}, {c} time(s)"
            for (kind, op, short), c in sorted(rows.items(), key=lambda kv: (-kv[1], kv[0]))]


def detect(loop, *, steps: int = 20, encoder_ms: float = 1.0,
          decoder_ms: float = 1.0, host_ms: float = 0.3, seed: int = 0,
           backend: str = "auto", pin_plan_inputs: bool = False) -> dict:
    """``loop(m, steps)`` once on CUDA under :func:`pinlab.detect_stalls`: its stalls, by line of the loop
    (:func:`stall_lines`), and the events the detector saw elsewhere (:func:`elsewhere_lines`: FlashInfer's
    ``plan()``, given pageable inputs unless ``pin_plan_inputs``), and the events of every kind. The loop's
    own lines count as the caller's (``detect_stalls(callers=[loop])``) also where it lives in pinlab, as
    :func:`fixed_loop` does: its calls are then its lines, not the notebook cell that ran it."""
    from ..detector import detect_stalls
    from ..streams import CudaStream

    callable_arg("loop", loop)
    require_cuda("detect()")
    s = CudaStream()
    m = CapstoneModel(s, **model_args(steps=steps, encoder_ms=encoder_ms, decoder_ms=decoder_ms,
                                      host_ms=host_ms, seed=seed,
                                      backend=backend), pin_plan_inputs=pin_plan_inputs)
    loop(m, min(2, steps))  # warm-up: first launches outside the report
    torch.cuda.synchronize()
    m.reset()
    with detect_stalls(max_events=None, callers=[loop]) as report:
        loop(m, steps)
    torch.cuda.synchronize()
    lines = stall_lines(report, loop)
    inside = sum(int(x.rsplit(", ", 1)[1].split()[0]) for x in lines)
    res = {"lines": lines, "events_in_loop": inside, "events_elsewhere": report.total - inside,
           "elsewhere": elsewhere_lines(report, loop), "counts": dict(report.counts), "steps": steps,
           "pin_plan_inputs": pin_plan_inputs, "backend": m.backend}
    del m
    gc.collect()
    return res


def before_after(loops, *, timeline_steps: int = 6, steps: int = 150, rounds: int = 3, encoder_ms: float = 1.0,
                 decoder_ms: float = 1.0, host_ms: float = 0.3, seed: int = 0, backend: str = "auto",
                 pinned_plan=()) -> dict:
    """:func:`throughput` and :func:`timeline` of the same loops (CUDA), in one result."""
    thr = throughput(loops, steps=steps, rounds=rounds, encoder_ms=encoder_ms, decoder_ms=decoder_ms,
                     host_ms=host_ms, seed=seed, backend=backend, pinned_plan=pinned_plan)
    tl = timeline(loops, steps=timeline_steps, encoder_ms=encoder_ms, decoder_ms=decoder_ms, host_ms=host_ms,
                  seed=seed, backend=backend, pinned_plan=pinned_plan)
    return {"throughput": thr, "timeline": tl}


#: The sample suite the race gate fails and passes (README, "Take-home tools"; docs/race_gate.md).
GATE_SAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "examples", "race_gate")


def run_gate(suite: str | None = None, *, timeout_s: float = 300) -> dict:
    """``pytest --pinlab-races`` on the sample suite (examples/race_gate) in a fresh process, as a team's CI
    would run it: its exit code, the counts pytest printed and the tail of its output.

    The suite is copied into a temporary folder with a ``pytest.ini`` of its own (the course's conftest stays
    out of it). Where pinlab is installed (``pip install -e .``) pytest finds the gate through its
    ``pytest11`` entry point; where it is not (the GPU suite runs a checkout), ``PYTEST_PLUGINS=pinlab_pytest``
    loads it, and ``lib/`` goes on ``PYTHONPATH``."""
    import shutil
    import subprocess
    import tempfile
    from importlib.metadata import entry_points

    suite = os.path.abspath(suite or GATE_SAMPLE)
    if not os.path.isdir(suite):
        raise FileNotFoundError(f"suite {suite!r} is not a folder: give the folder of a test suite "
                                "(the course's sample is examples/race_gate)")
    positive_number("timeout_s", timeout_s)
    lib = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([lib] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PY_COLORS="0")  # plain text to parse, also where the environment forces colour (FORCE_COLOR)
    env.pop("FORCE_COLOR", None)
    env.pop("PYTEST_ADDOPTS", None)  # the caller's pytest options (e.g. --durations) would change the gate's report
    if not any(ep.name == "pinlab" for ep in entry_points(group="pytest11")):
        env["PYTEST_PLUGINS"] = "pinlab_pytest"
    with tempfile.TemporaryDirectory(prefix="pinlab-gate-") as tmp:
        dst = os.path.join(tmp, "suite")
        shutil.copytree(suite, dst, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
        with open(os.path.join(dst, "pytest.ini"), "w", encoding="utf-8") as f:
            f.write("[pytest]\naddopts = -p no:cacheprovider\n")
        cmd = [sys.executable, "-m", "pytest", "-q", "--color=no", "--pinlab-races", "."]
        done = subprocess.run(cmd, cwd=dst, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # colour codes, should any remain
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors)\b", out.splitlines()[-1] if out else "")}
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    return {"command": "pytest -q --pinlab-races examples/race_gate", "returncode": done.returncode,
            "passed": counts.get("passed", 0), "failed": counts.get("failed", 0), "failed_tests": failed,
            "tail": "\n".join(out.splitlines()[-25:]), "stderr_tail": "\n".join(done.stderr.splitlines()[-5:])}


def per_step_line(step_ms: float, host_ms: float, host_profiled_ms: float, gpu_ms: float | None) -> str:
    """The notebook's ``per step`` line of one loop: its step time, the host's time in the engine's calls
    without and under the profiler, and the GPU's busy time on the timeline (None: not measured)."""
    return (f"{step_ms:.2f} ms; host time in the engine's calls {host_ms:.2f} ms without the profiler, "
            f"{host_profiled_ms:.2f} ms under it; GPU busy "
            + ("not measured" if gpu_ms is None else f"{gpu_ms:.2f} ms (kernels or copies, timeline)"))


#: why a claim (or an observed line) of the notebook may not hold on some machine (``why=l07.WHY.name``)
WHY = Reasons(
    emulated="the emulated stream is exact about the order of host writes, copies and reads, on every machine",
    detector="the detector classifies calls, not timings: it names them on any CUDA GPU",
    gate="the racy loop rewrites its pinned buffer while the GPU (1 ms behind per step) has not copied it; the "
         "fixes never do. A different count is a bug in the gate, or a host slower than 1 ms per step",
    audit="the audit counts calls, not time: the same on the emulated stream and on any GPU",
    plan_copies="a FlashInfer version whose plan() copies host tensors of its own that pinlab does not hand it "
                "pinned (the value names where)",
    checker="the ring's events make every copy run before its buffer is rewritten or read, on any GPU (the "
            "checker's line above says what it found)",
    overlap="the fixed loop gains by overlapping host and GPU work: a host so slow that its work alone sets the "
            "pace (few CPU cores shared with others) leaves it little to gain",
    profiler="the profiler names every copy of this process; only a library copying from pageable memory of its "
             "own shows one",
    shares="the host's share counts the engine's calls only: the loop's own calls (copies, events, the ring's "
           "waits) and a host slowed down by other processes add to it",
    pinned="a pinned tensor of this notebook is still referenced (a loop's ring, a model not yet collected), or "
           "another library in this process took pinned memory",
)
