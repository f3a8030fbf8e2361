"""Lesson 09: audit real code: HF transformers ``generate()``, a DataLoader.

The experiments and their plumbing; the key code (the deferred stop check, the loops audited) is in the
notebook (``notebooks/src/09_real_code.py``) and in :class:`DeferredStop` here, which the notebook shows.

* :func:`tiny_llama`: a random ``LlamaForCausalLM`` built from a config (hidden 64, 2 layers): nothing to
  download; :func:`greedy` runs ``generate()`` on it with the default stop check or a deferred one;
* :func:`audit_generate` (GPU): ``generate()`` under :func:`pinlab.detect_stalls` and ``torch.profiler``
  together, each torch call the detector intercepts inside its own ``record_function`` window, so that
  every event the detector reports is matched with the runtime calls (``cudaStreamSynchronize``,
  ``cudaMemcpyAsync``) the trace shows inside its window: precision and recall against the trace;
* :func:`stop_checks` (GPU): the default stop check against the deferred one: tokens, syncs per token
  in the trace, tokens per second over interleaved rounds;
* :func:`audit_dataloader` (GPU): a DataLoader's batches moved with ``.to("cuda", non_blocking=True)``,
  ``pin_memory`` False and True: the detector's count against the trace's ``Pageable -> Device`` /
  ``Pinned -> Device`` copies.

What transformers does is read from its source (the installed wheel, 5.17.0, and the repository):
``generation/utils.py`` ``StopCheck.__call__`` (``bool(unfinished_sequences.max() == 0)``, every step),
``DeferredStopCheck`` (two pinned slots, a ``non_blocking`` copy of the flag, an event, the other slot read
one step late; ``is_supported`` enables it on ``mps`` only), ``masking_utils.py``
``_ignore_causal_mask_sdpa`` (``fast_all(padding_mask)``, every step), ``cache_utils.py``
``DynamicLayer.lazy_initialization`` (``torch.tensor([], device=...)``: empty, copies nothing).
"""
from __future__ import annotations

import contextlib
import json
import linecache
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from .. import detector as _det
from ..args import positive_int, require_cuda
from ..races import D2H_READ  # noqa: F401  (the notebook names the 1-slot ring's finding by it)

PAGEABLE_MEMCPY = "Memcpy HtoD (Pageable -> Device)"
PINNED_MEMCPY = "Memcpy HtoD (Pinned -> Device)"
#: the detector's kinds that make the host wait (a sync, a blocking copy, a factory's blocking copy)
WAITING_KINDS = (_det.BLOCKING_COPY, _det.ITEM_SYNC, _det.TOLIST_SYNC, _det.SCALAR_SYNC, _det.FACTORY_SYNC)


def transformers_version() -> str | None:
    """The installed transformers' version, or None where it is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def require_transformers(what: str):
    """Import transformers, or say in one sentence how to get it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{what} needs HF transformers: pip install 'transformers>=5.17,<5.18' "
                          "(make setup installs it)") from None
    return transformers


# --- the model ------------------------------------------------------------------------------------


def tiny_llama(device="cpu", seed: int = 0):
    """A random ``LlamaForCausalLM`` from a config (hidden 64, 2 layers, vocabulary 256): no download.
    End-of-sequence is switched off, so that ``generate()`` always makes ``max_new_tokens`` tokens and
    per-token counts are exact."""
    require_transformers("tiny_llama()")
    from transformers import LlamaConfig, LlamaForCausalLM

    seed = positive_int("seed", seed, allow_zero=True)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device)


def prompt(batch: int = 2, length: int = 8, seed: int = 0, device="cpu"):
    """A fixed batch of random token ids (and its all-ones attention mask)."""
    batch, length = positive_int("batch", batch), positive_int("length", length)
    g = torch.Generator().manual_seed(positive_int("seed", seed, allow_zero=True))
    ids = torch.randint(3, 256, (batch, length), generator=g)
    return ids.to(device), torch.ones_like(ids).to(device)


# --- the deferred stop check: the course's own, modelled on transformers' DeferredStopCheck --------


class DeferredStop:
    """A stop check that reads the "all finished" flag one step late, so the host never waits for it.

    Modelled on transformers' ``generation/utils.py`` ``DeferredStopCheck``: each step copies the flag
    ``unfinished.max() == 0`` into a pinned slot with ``non_blocking=True`` and records an event; it then
    waits for the *previous* step's event (the GPU has this step queued behind it, so it does not run dry)
    and reads the previous step's slot. With ``slots=2`` that slot is the other one; with ``slots=1`` it is
    the slot this step's copy is still writing: a read of a pending D2H copy (the race).

    It has the constructor and calls ``generate()`` uses (``__call__(unfinished, tokens, length)`` ->
    stop?, ``finish()`` -> steps to undo), so :func:`greedy` can hand it to ``generate()``; the stream gives
    the events (``pinlab.stream()``: CUDA, or the emulated stream on a CPU).
    """

    def __init__(self, stream, max_length=None, slots: int = 2):
        self.stream, self.max_length = stream, max_length
        slots = positive_int("slots", slots)
        self.flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(slots)]
        self.last, self.n, self.stop_reported = None, 0, False

    def __call__(self, unfinished, tokens=None, length=None) -> bool:
        n, k = self.n, len(self.flags)
        self.flags[n % k].copy_(unfinished.max() == 0, non_blocking=True)  # this step's flag, asynchronously
        done = self.stream.Event()
        done.record()
        if self.last is not None:
            self.last.synchronize()                   # the previous step's copy has run; this step is queued
            self.stop_reported = bool(self.flags[(n - 1) % k])  # the previous step's flag: one step late
        self.last, self.n = done, n + 1
        return self.stop_reported or (self.max_length is not None and length is not None
                                      and length >= self.max_length)

    def finish(self) -> int:
        """Steps to undo: the one decoded after the step whose flag said stop (generate() drops it)."""
        if self.last is not None:
            self.last.synchronize()
        return 1 if self.stop_reported else 0


@contextlib.contextmanager
def deferred_in_generate(stream, slots: int = 2, use="course"):
    """Make ``generate()`` use a deferred stop check on any device: ``use="course"`` hands it
    :class:`DeferredStop`; ``use="transformers"`` turns transformers' own ``DeferredStopCheck`` on
    (its ``is_supported`` says ``mps`` only; the rest of its rule, about a returned cache, is kept)."""
    require_transformers("deferred_in_generate()")
    from unittest import mock

    from transformers.generation import utils as gu

    def supported(device, cache, cache_is_returned, is_assistant):
        return not is_assistant and (cache is None or cache.is_croppable or not cache_is_returned)

    if use == "transformers":
        if not hasattr(gu, "DeferredStopCheck"):
            raise RuntimeError(f"transformers {transformers_version()} has no DeferredStopCheck: use='course'")
        with mock.patch.object(gu.DeferredStopCheck, "is_supported", staticmethod(supported)):
            yield
        return
    if use != "course":
        raise ValueError(f"use must be 'course' or 'transformers', got {use!r}")

    class Course(DeferredStop):
        is_supported = staticmethod(supported)

        def __init__(self, input_ids, max_length, cache, cache_is_returned, streamer=None):
            if cache_is_returned and cache is not None:
                raise RuntimeError("the course's DeferredStop does not roll back a returned cache")
            super().__init__(stream, max_length, slots)

    if not hasattr(gu, "DeferredStopCheck"):
        raise RuntimeError(f"transformers {transformers_version()} has no DeferredStopCheck hook in generate()")
    with mock.patch.object(gu, "DeferredStopCheck", Course):
        yield


def greedy(model, ids, mask, new_tokens: int = 24, deferred=None, stream=None, slots: int = 2):
    """Greedy ``generate()``: ``deferred`` None (transformers' default stop check), ``"course"``
    (:class:`DeferredStop` on ``stream``) or ``"transformers"`` (its own ``DeferredStopCheck``, CUDA)."""
    new_tokens = positive_int("new_tokens", new_tokens)
    ctx = contextlib.nullcontext() if deferred is None else deferred_in_generate(stream, slots, deferred)
    with ctx, torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


# --- matching the detector with the trace -----------------------------------------------------------


class _Windows(TorchFunctionMode):
    """Entered *inside* a detect_stalls block: puts each call the detector intercepts in its own
    ``record_function`` window and notes which detector event (if any) it produced; also counts the
    zero-element factory calls (which the detector, since lesson 09, does not report)."""

    def __init__(self, report):
        super().__init__()
        self.report, self.k, self.windows, self.empty = report, 0, {}, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _det._HANDLERS:
            return func(*args, **kwargs)
        from torch.profiler import record_function

        k, self.k = self.k, self.k + 1
        before = self.report.total
        if func in (torch.tensor, torch.as_tensor) and args and _det.copies_nothing(args[0]):
            device = kwargs.get("device")
            if device is not None and _det._device_type(device) == "cuda":
                self.empty[_det.find_caller(sys._getframe(1))] += 1
        with record_function(f"pinlab09:{k}"):
            out = func(*args, **kwargs)
        if self.report.total > before:
            self.windows[f"pinlab09:{k}"] = before  # the index of the detector's event
        return out


def _trace(prof) -> list[dict]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    finally:
        os.unlink(path)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _is_sync(name: str) -> bool:
    return "Synchronize" in name


def short_where(where: str) -> str:
    """``.../site-packages/transformers/generation/utils.py:383`` -> ``transformers/generation/utils.py:383``."""
    for pkg in ("transformers", "torch"):
        marker = f"{os.sep}{pkg}{os.sep}"
        if marker in where:
            return pkg + os.sep + where.rsplit(marker, 1)[1]
    return os.path.basename(where)


def code_at(where: str) -> tuple[str, str]:
    """(the source line at ``file:line``, the function it is in), read from the file."""
    path, _, line = where.rpartition(":")
    try:
        n = int(line)
    except ValueError:
        return "", ""
    code = linecache.getline(path, n).strip()
    func = ""
    for i in range(n, 0, -1):
        text = linecache.getline(path, i).lstrip()
        if text.startswith("def "):
            func = text[4:].split("(", 1)[0]
            break
    return code, func


def match(events, windows: dict, report_events, region: str) -> dict:
    """Match detector events with the trace: each reported event's window holds a runtime sync or copy
    (a true positive) or not (a false positive); a sync of the region outside every reported window is
    one the detector missed. Pure: tested on the CPU with a synthetic trace."""
    ann = {e["name"]: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
           for e in events if str(e.get("cat", "")).lower() == "user_annotation"}
    if region not in ann:
        raise ValueError(f"the trace holds no annotation {region!r}")
    r0, r1 = ann[region]
    runtime = [(float(e["ts"]), str(e["name"])) for e in events
               if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver") and r0 <= float(e["ts"]) <= r1]
    spans = {w: ann[w] for w in windows if w in ann}
    per_event, hit = [], set()
    for w, i in sorted(windows.items(), key=lambda kv: kv[1]):
        a, b = spans.get(w, (0.0, -1.0))
        inside = [(ts, name) for ts, name in runtime if a <= ts <= b]
        hit.update(inside)
        syncs = sum(_is_sync(n) for _, n in inside)
        copies = sum(n.startswith("cudaMemcpy") for _, n in inside)
        ev = report_events[i] if i < len(report_events) else None
        per_event.append({"where": ev.where if ev else "?", "kind": ev.kind if ev else "?",
                          "syncs": syncs, "copies": copies, "matched": bool(syncs or copies)})
    syncs_total = [(ts, n) for ts, n in runtime if _is_sync(n)]
    missed = [n for ts, n in syncs_total if (ts, n) not in hit]
    tp = sum(e["matched"] for e in per_event)
    return {"reported": len(per_event), "true_positives": tp, "false_positives": len(per_event) - tp,
            "trace_syncs": len(syncs_total), "syncs_in_reported_windows": len(syncs_total) - len(missed),
            "missed": Counter(missed), "per_event": per_event}


def _places(per_event) -> list[dict]:
    by = {}
    for e in per_event:
        key = (e["kind"], e["where"])
        row = by.setdefault(key, {"kind": e["kind"], "where": short_where(e["where"]), "n": 0, "matched": 0,
                                  "code": "", "function": ""})
        row["n"] += 1
        row["matched"] += e["matched"]
        if not row["code"]:
            row["code"], row["function"] = code_at(e["where"])
    return sorted(by.values(), key=lambda r: (-r["n"], r["where"]))


def audit_generate(new_tokens: int = 24, batch: int = 2, seed: int = 0) -> dict:
    """GPU: ``generate()`` under detect_stalls and torch.profiler, every detector event matched with the
    trace. Returns the versions, the places (kind, file:line, count, the code there, how many matched),
    precision and recall, the trace's sync and H2D copy counts, and the empty factories not reported."""
    require_cuda("audit_generate()")
    from torch.profiler import ProfilerActivity, profile, record_function

    model = tiny_llama("cuda", seed)
    ids, mask = prompt(batch, seed=seed, device="cuda")
    greedy(model, ids, mask, new_tokens)  # warm-up: every kernel launched once (lazy module loading)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with _det.detect_stalls(max_events=None) as report, _Windows(report) as win:
            with record_function("09_generate"):
                out = greedy(model, ids, mask, new_tokens)
        torch.cuda.synchronize()
    events = _trace(prof)
    m = match(events, win.windows, report.events, "09_generate")
    r0, r1 = next((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("name") == "09_generate" and str(e.get("cat", "")).lower() == "user_annotation")
    corr = {(e.get("args") or {}).get("correlation") for e in events
            if str(e.get("cat", "")).lower() == "cuda_runtime" and r0 <= float(e["ts"]) <= r1}
    memcpy = Counter(str(e["name"]) for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"
                     and (e.get("args") or {}).get("correlation") in corr)
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "new_tokens": new_tokens, "batch": batch, "generated": int(out.shape[1] - ids.shape[1]),
            "counts": dict(report.counts), "places": _places(m.pop("per_event")),
            **{k: (dict(v) if isinstance(v, Counter) else v) for k, v in m.items()},
            "memcpy": dict(memcpy),
            "factories_h2d": report.counts.get(_det.FACTORY_SYNC, 0),
            "empty_factories": {short_where(k): v for k, v in win.empty.items()},
            "gpu_trace": bool(memcpy) or any(str(e.get("cat", "")).lower() == "kernel" for e in events)}


def _syncs_per_run(model, ids, mask, new_tokens, deferred) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("09_stop"):
            out = greedy(model, ids, mask, new_tokens, deferred=deferred)
        torch.cuda.synchronize()
    events = _trace(prof)
    r0, r1 = next((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("name") == "09_stop" and str(e.get("cat", "")).lower() == "user_annotation")
    names = Counter(str(e["name"]) for e in events if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver")
                    and r0 <= float(e["ts"]) <= r1 and _is_sync(str(e["name"])))
    return {"tokens": out.tolist(), "syncs": dict(names)}


def stop_checks(new_tokens: int = 24, batch: int = 2, rounds: int = 5, seed: int = 0) -> dict:
    """GPU: transformers' default stop check against the deferred one (transformers' own
    ``DeferredStopCheck`` turned on for CUDA where the installed version has it, else the course's):
    the tokens, the trace's syncs by name, and tokens per second (median of ``rounds`` interleaved
    rounds, and each round's ratio)."""
    require_cuda("stop_checks()")
    from transformers.generation import utils as gu

    rounds = positive_int("rounds", rounds)
    use = "transformers" if hasattr(gu, "DeferredStopCheck") and hasattr(gu.DeferredStopCheck, "is_supported") \
        else "course"
    model = tiny_llama("cuda", seed)
    ids, mask = prompt(batch, seed=seed, device="cuda")
    modes = {"default": None, "deferred": use}
    out = {"deferred_is": f"transformers' DeferredStopCheck" if use == "transformers" else "the course's DeferredStop",
           "transformers": require_transformers("stop_checks()").__version__, "runs": {}}
    for name, d in modes.items():  # warm-up
        greedy(model, ids, mask, new_tokens, deferred=d)
    torch.cuda.synchronize()
    for name, d in modes.items():
        out["runs"][name] = _syncs_per_run(model, ids, mask, new_tokens, d)
    times = {name: [] for name in modes}
    for _ in range(rounds):
        for name, d in modes.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            greedy(model, ids, mask, new_tokens, deferred=d)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    tokens = batch * new_tokens
    for name in modes:
        out["runs"][name]["tokens_per_s"] = tokens / statistics.median(times[name])
    out["ratios"] = [a / b for a, b in zip(times["default"], times["deferred"])]  # deferred's speed-up per round
    return out


def race_ring(stream, slots: int, steps: int = 16, busy_ms: float = 1.0) -> dict:
    """The deferred stop check in a plain loop on ``stream``: each step the GPU works ``busy_ms`` (the
    step's forward: a wide lead over the host's microseconds), updates ``unfinished`` and the check
    copies its flag; run under ``detect_races``. Returns the findings by kind and the
    decisions (which step each check saw stop)."""
    from ..races import detect_races

    positive_int("steps", steps)
    with detect_races() as races:
        unfinished = torch.ones(2, dtype=torch.int64, device=stream.device)
        check = DeferredStop(stream, slots=slots)
        stopped_at = None
        for n in range(steps):
            stream.busy(busy_ms)                   # the step's forward
            if n == steps // 2:
                unfinished.zero_()                 # every sequence finished in step n (on the GPU)
            if check(unfinished) and stopped_at is None:
                stopped_at = n
        check.finish()
        stream.synchronize()
    return {"findings": dict(races.counts), "stopped_at": stopped_at, "total": races.total}


def measure_or_say(name: str, fn, requires=None, **params):
    """:func:`pinlab.measure`, or None after one sentence where there is no CUDA and no recording yet."""
    from ..replay import ReplayMissingError, measure

    try:
        return measure(name, fn, requires=requires, **params)
    except ReplayMissingError:
        print(f"{name}: no GPU here and no recorded GPU run yet (reports/gpu/data/{name}.json): "
              "the GPU suite records it; this section is skipped.")
        return None


def audit_dataloader(batches: int = 8, batch_size: int = 4, features: int = 1024) -> dict:
    """GPU: a DataLoader (num_workers 0) of ``batches`` batches of two tensors, each moved with
    ``.to("cuda", non_blocking=True)``, with ``pin_memory`` False and True, under detect_stalls and
    torch.profiler: the detector's pageable H2D count and the trace's H2D copies by name."""
    require_cuda("audit_dataloader()")
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.data import DataLoader, TensorDataset

    n = positive_int("batches", batches) * positive_int("batch_size", batch_size)
    data = TensorDataset(torch.randn(n, positive_int("features", features)), torch.arange(n))
    out = {}
    for pin in (False, True):
        loader = DataLoader(data, batch_size=batch_size, pin_memory=pin, num_workers=0)
        for x, y in loader:  # warm-up
            x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with _det.detect_stalls(max_events=None) as report, record_function("09_loader"):
                moved = 0
                for x, y in loader:
                    x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
                    moved += 2
            torch.cuda.synchronize()
        events = _trace(prof)
        memcpy = Counter(str(e["name"]) for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"
                         and "HtoD" in str(e["name"]))
        out["pinned" if pin else "pageable"] = {
            "moved": moved, "detector": dict(report.counts),
            "detector_pageable": report.counts.get(_det.PAGEABLE_H2D, 0), "memcpy": dict(memcpy)}
    return out
