"""Lesson 09: audit real code: HF transformers ``generate()``, a DataLoader, FlashInfer's ``plan()``.

The experiments and their plumbing; the key code (the deferred stop check, the loops audited) is in the
notebook (``notebooks/src/09_real_code.py``) and in :class:`DeferredStop` here, which the notebook shows.
Why about 1,000 lines: four workloads of three libraries, each measured against the profiler's trace or
in child processes, in two transformers releases, padded and by batch size, with the sentences, tables
and figure the notebook computes from them.

* :func:`tiny_llama`: a random ``LlamaForCausalLM`` built from a config (hidden 64, 2 layers): nothing to
  download; :func:`greedy` runs ``generate()`` on it with the default stop check or a deferred one;
* :func:`audit_generate` (GPU): ``generate()`` under :func:`pinlab.detect_stalls` and ``torch.profiler``
  together, each torch call the detector intercepts inside its own ``record_function`` window, so that
  every event the detector reports is matched with the runtime calls (``cudaStreamSynchronize``,
  ``cudaMemcpyAsync``) the trace shows inside its window: precision and recall against the trace;
* :func:`stop_checks` (GPU): the default stop check against the deferred one: tokens, syncs per token
  in the trace, the host's time waiting in them and the GPU's idle share, tokens per second over
  interleaved rounds; ``gpu_ms`` adds GPU work to every forward (a step as long as a larger model's);
  :func:`stop_checks_newer` runs it with the newer transformers, whose ``generate()`` drops an all-ones
  attention mask once up front (since 5.18.0; 5.25.0 ``generation/utils.py``: "We can drop the mask
  altogether if it's all 1s"), so that its mask builder no longer syncs every token;
* :func:`audit_dataloader` (GPU): a DataLoader's batches moved with ``.to("cuda", non_blocking=True)``,
  ``pin_memory`` False and True: the detector's count against the trace's ``Pageable -> Device`` /
  ``Pinned -> Device`` copies.
* :func:`audit_flashinfer` (GPU): FlashInfer decode steps with pageable plan inputs under detect_stalls and
  the profiler, matched as for ``generate()``;
* :func:`plan_staging` (GPU, child processes): two FlashInfer decode steps under :func:`pinlab.detect_races`,
  each ``plan()``'s own C++ copy of its plan info declared with ``RaceDetector.copied``: one wrapper with the
  host ahead, one wrapper per step in flight, and an event wait before re-planning.

What transformers does is read from its source (the wheels of the oldest and the newest release of
:data:`SUPPORTED_TRANSFORMERS`, 5.17.0 and 5.25.0, and the repository):
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
import threading
import time
import warnings
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from .. import detector as _det
from ..args import one_of, positive_int, positive_number
from ..busy import gpu_busy
from ..child import run_child
from ..claims import Reasons
from ..copyargs import device_type
from ..device import require_cuda
from ..paged_kv import _device_arg
from ..profiler import idle_share
from ..races import D2H_READ  # noqa: F401  (the notebook names the 1-slot ring's finding by it)
from ..steploop import cuda_or
from ..timing import interleaved, show, table

PAGEABLE_MEMCPY = "Memcpy HtoD (Pageable -> Device)"
PINNED_MEMCPY = "Memcpy HtoD (Pinned -> Device)"
#: the detector's kinds that make the host wait (a sync, a blocking copy, a factory's blocking copy)
WAITING_KINDS = (_det.BLOCKING_COPY, _det.ITEM_SYNC, _det.TOLIST_SYNC, _det.SCALAR_SYNC, _det.FACTORY_SYNC)
#: the releases the lesson is tested on (pyproject.toml's lab extra says the same; tests/test_l09_versions.py
#: runs the lesson's tests on the oldest and the newest of them): 5.17 is the GPU image's, 5.25 the newest
SUPPORTED_TRANSFORMERS = ">=5.17,<5.26"
#: tqdm.auto, which transformers and huggingface_hub import, warns "IProgress not found" in a notebook without
#: ipywidgets, naming its own file by its absolute path: the lesson shows no widget, and the path is the machine's
warnings.filterwarnings("ignore", message="IProgress not found")
#: the bounds the experiments check their arguments against, before they ask for CUDA: torch.manual_seed's range,
#: the tiny model's positions (a prompt and its new tokens must fit), a prompt's default length, the largest batch
#: (the sweep's is 64), and a plain loop's steps, slots and rounds (beyond them a typo is a hang, not a lesson)
SEED_MAX = 2**64 - 1
MAX_POSITIONS = 256
PROMPT_LENGTH = 8
MAX_BATCH = 4096
MAX_STEPS, MAX_SLOTS, MAX_ROUNDS = 10_000, 64, 1_000


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
        raise ImportError(f"{what} needs HF transformers: pip install 'transformers{SUPPORTED_TRANSFORMERS}' "
                          "(make setup installs it)") from None
    return transformers


# --- the model ------------------------------------------------------------------------------------


def tiny_llama(device="cpu", seed: int = 0):
    """A random ``LlamaForCausalLM`` from a config (hidden 64, 2 layers, vocabulary 256): no download.
    End-of-sequence is switched off, so that ``generate()`` always makes ``max_new_tokens`` tokens and
    per-token counts are exact."""
    require_transformers("tiny_llama()")
    from transformers import LlamaConfig, LlamaForCausalLM

    seed, device = _seed(seed), _device(device, "tiny_llama")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=MAX_POSITIONS)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device)


def _seed(seed) -> int:
    return positive_int("seed", seed, allow_zero=True, maximum=SEED_MAX)


def _device(device, what: str) -> torch.device:
    """``device`` (a str such as 'cpu' or 'cuda', or a torch.device) checked before torch sees it; a CUDA one
    only where CUDA runs (CudaUnavailableError naming ``what``)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda', or a torch.device, got "
                        f"{type(device).__name__} ({device!r})"[:200])
    return _device_arg(device, what)


def _run_args(new_tokens, batch, seed) -> tuple[int, int, int]:
    """The arguments of every ``generate()`` experiment, checked before it asks for CUDA: new tokens that fit the
    tiny model's positions after the prompt, a batch up to :data:`MAX_BATCH`, a seed in torch's range."""
    return (positive_int("new_tokens", new_tokens, maximum=MAX_POSITIONS - PROMPT_LENGTH),
            positive_int("batch", batch, maximum=MAX_BATCH), _seed(seed))


def prompt(batch: int = 2, length: int = PROMPT_LENGTH, seed: int = 0, device="cpu", left_pad: int = 0):
    """A fixed batch of random token ids and its attention mask: all ones, or with the first ``left_pad``
    positions of the first prompt padding (id 0, mask 0: a shorter prompt, left-padded as a batch of
    prompts of different lengths is)."""
    batch = positive_int("batch", batch, maximum=MAX_BATCH)
    length = positive_int("length", length, maximum=MAX_POSITIONS)
    left_pad = positive_int("left_pad", left_pad, allow_zero=True)
    if left_pad >= length:
        raise ValueError(f"left_pad must be below the prompt's length ({length}), got {left_pad}: a prompt "
                         "needs at least one real token")
    g, device = torch.Generator().manual_seed(_seed(seed)), _device(device, "prompt")
    ids = torch.randint(3, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :left_pad], mask[0, :left_pad] = 0, 0
    return ids.to(device), mask.to(device)


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


def greedy(model, ids, mask, new_tokens: int = 24, deferred=None, stream=None, slots: int = 2, **generate_kwargs):
    """Greedy ``generate()``: ``deferred`` None (transformers' default stop check), ``"course"``
    (:class:`DeferredStop` on ``stream``) or ``"transformers"`` (its own ``DeferredStopCheck``, CUDA);
    ``generate_kwargs`` go to ``generate()`` (e.g. :func:`issue_43089_kwargs`)."""
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"model must be a transformers model with generate(), such as tiny_llama(), got "
                        f"{type(model).__name__}")
    for name, t in (("ids", ids), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise TypeError(f"{name} must be a 2-D tensor (batch, length), as prompt() returns, got "
                            f"{type(t).__name__} ({t!r})"[:200])
    if mask.shape != ids.shape:
        raise ValueError(f"mask must have the shape of ids, {tuple(ids.shape)}, got {tuple(mask.shape)}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    room = positions - ids.shape[1] if isinstance(positions, int) else None
    if room is not None and room < 1:
        raise ValueError(f"ids must leave the model room for a new token: {ids.shape[1]} positions of {positions}")
    new_tokens = positive_int("new_tokens", new_tokens, maximum=room)
    if deferred is not None:
        one_of("deferred", deferred, ("course", "transformers"))
        if deferred == "course" and stream is None:
            raise TypeError("stream must be a pinlab stream with deferred='course' (pinlab.stream(): the check's "
                            "events), got None")
        if deferred == "transformers":
            require_cuda("greedy(deferred='transformers')")
            if ids.device.type == "cpu":
                raise ValueError("ids must be on the GPU with deferred='transformers' (its DeferredStopCheck "
                                 "records device events), got ids on the CPU")
    ctx = contextlib.nullcontext() if deferred is None else deferred_in_generate(stream, slots, deferred)
    with ctx, torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              **generate_kwargs)


def issue_43089_kwargs() -> dict:
    """The stopping criterion and logits processor of transformers#43089's benchmark script (2026-01-03, on
    5.0.0.dev0, reporting "3.25 GPU syncs per token"): a criterion that returns an all-False bool tensor on the
    GPU every step (``AlwaysPassStoppingCriteria``) and a processor that takes the log of a softmax of the
    scores (``ExtraSoftmaxLogitsProcessor``), as ``generate()`` keyword arguments."""
    require_transformers("issue_43089_kwargs()")
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class AlwaysPassStoppingCriteria(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    class ExtraSoftmaxLogitsProcessor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.log(torch.softmax(scores, dim=-1) + 1e-10)

    return {"stopping_criteria": StoppingCriteriaList([AlwaysPassStoppingCriteria()]),
            "logits_processor": LogitsProcessorList([ExtraSoftmaxLogitsProcessor()])}


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
            if device is not None and device_type(device) == "cuda":
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


def audit_generate(new_tokens: int = 24, batch: int = 2, seed: int = 0, left_pad: int = 0,
                   issue_43089: bool = False) -> dict:
    """GPU: ``generate()`` under detect_stalls and torch.profiler, every detector event matched with the
    trace. Returns the versions, the places (kind, file:line, count, the code there, how many matched),
    precision and recall, the trace's sync and H2D copy counts, and the empty factories not reported.
    ``left_pad``: the first prompt left-padded (:func:`prompt`); ``issue_43089``: with that issue's stopping
    criterion and logits processor (:func:`issue_43089_kwargs`)."""
    new_tokens, batch, seed = _run_args(new_tokens, batch, seed)
    left_pad = positive_int("left_pad", left_pad, allow_zero=True, maximum=PROMPT_LENGTH - 1)
    if not isinstance(issue_43089, bool):
        raise TypeError(f"issue_43089 must be True or False, got {issue_43089!r}")
    require_cuda("audit_generate()")
    from torch.profiler import ProfilerActivity, profile, record_function

    model = tiny_llama("cuda", seed)
    ids, mask = prompt(batch, seed=seed, device="cuda", left_pad=left_pad)
    extra = issue_43089_kwargs() if issue_43089 else {}
    greedy(model, ids, mask, new_tokens, **extra)  # warm-up: every kernel launched once (lazy module loading)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with _det.detect_stalls(max_events=None) as report, _Windows(report) as win:
            with record_function("09_generate"):
                out = greedy(model, ids, mask, new_tokens, **extra)
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
            "new_tokens": new_tokens, "batch": batch, "left_pad": left_pad, "issue_43089": issue_43089,
            "generated": int(out.shape[1] - ids.shape[1]),
            "counts": dict(report.counts), "places": _places(m.pop("per_event")),
            **{k: (dict(v) if isinstance(v, Counter) else v) for k, v in m.items()},
            "memcpy": dict(memcpy),
            "factories_h2d": report.counts.get(_det.FACTORY_SYNC, 0),
            "empty_factories": {short_where(k): v for k, v in win.empty.items()},
            "gpu_trace": bool(memcpy) or any(str(e.get("cat", "")).lower() == "kernel" for e in events)}


def _in_newer(fn: str, args, what: str) -> dict:
    """Run ``l09.<fn>(*args)`` in a fresh Python process whose ``transformers`` is the newer release installed in
    the folder ``$PINLAB_TRANSFORMERS_NEWER`` names (:func:`pinlab.probe.newer_transformers_dir`); its result."""
    require_cuda(what)
    from ..probe import NEWER_TRANSFORMERS_ENV, newer_transformers_dir

    folder = newer_transformers_dir()
    if folder is None:
        raise RuntimeError(f"{what} needs a newer transformers installed in a folder named by "
                           f"${NEWER_TRANSFORMERS_ENV} (the README's GPU recipe installs the carried wheel there)")
    lib = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import json, sys; from pinlab.child import MARK; from pinlab.lessons import l09_real_code as l09; "
            f"print(MARK + json.dumps(l09.{fn}(*json.loads(sys.argv[1]))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [folder, lib] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    res = run_child(code, (json.dumps(list(args)),), env=env, timeout_s=900.0)
    if set(res) == {"error"}:
        raise RuntimeError(f"{what} with the newer transformers failed: {res['error']}")
    return res


def audit_newer(new_tokens: int = 24, batch: int = 2, seed: int = 0, left_pad: int = 0) -> dict:
    """GPU: :func:`audit_generate` in a fresh process with the newer transformers (:func:`_in_newer`), so that
    the syncs of two versions can be compared."""
    new_tokens, batch, seed = _run_args(new_tokens, batch, seed)
    left_pad = positive_int("left_pad", left_pad, allow_zero=True, maximum=PROMPT_LENGTH - 1)
    return _in_newer("audit_generate", (new_tokens, batch, seed, left_pad), "audit_newer()")


def stop_checks_newer(new_tokens: int = 24, batch: int = 2, rounds: int = 5, seed: int = 0,
                      gpu_ms: float = 0.0) -> dict:
    """GPU: :func:`stop_checks` in a fresh process with the newer transformers (:func:`_in_newer`)."""
    args = _stop_args(new_tokens, batch, rounds, seed, gpu_ms)
    return _in_newer("stop_checks", args, "stop_checks_newer()")


def _stop_args(new_tokens, batch, rounds, seed, gpu_ms) -> tuple:
    """:func:`stop_checks`' arguments, checked before it asks for CUDA."""
    new_tokens, batch, seed = _run_args(new_tokens, batch, seed)
    rounds = positive_int("rounds", rounds, maximum=MAX_ROUNDS)
    return new_tokens, batch, rounds, seed, positive_number("gpu_ms", gpu_ms, allow_zero=True, maximum=100.0)


def _place_key(p: dict) -> tuple:
    return p["kind"], p["function"], p["code"]


def compare_audits(a: dict, b: dict) -> list[dict]:
    """Rows of the places two :func:`audit_generate` results report (matched by kind, function and source
    line, since line numbers move between versions): the count in each, 0 where a version has none."""
    rows = {}
    for which, res in (("a", a), ("b", b)):
        for p in res["places"]:
            row = rows.setdefault(_place_key(p), {"kind": p["kind"], "function": p["function"], "code": p["code"],
                                                  "a": 0, "b": 0, "where_a": "", "where_b": ""})
            row[which] += p["n"]
            row[f"where_{which}"] = p["where"]
    return sorted(rows.values(), key=lambda r: (-max(r["a"], r["b"]), r["function"]))


def waits_per_token(res: dict) -> float:
    """Host waits per new token in one :func:`audit_generate` result (the kinds that make the host wait)."""
    return sum(p["n"] for p in res["places"] if p["kind"] in WAITING_KINDS) / res["new_tokens"]


def changes_text(a: dict, b: dict) -> str:
    """One sentence on what differs between two audits, computed from them."""
    rows = compare_audits(a, b)
    gone = [r for r in rows if r["a"] and not r["b"]]
    new = [r for r in rows if r["b"] and not r["a"]]
    moved = [r for r in rows if r["a"] and r["b"] and r["a"] != r["b"]]
    va, vb = a["transformers"], b["transformers"]
    if not (gone or new or moved):
        return (f"transformers {vb} makes the same calls as {va}, as often: {len(rows)} places, the same counts "
                f"(only their line numbers may differ)")
    parts = [f"{len(gone)} place(s) of {va} gone" if gone else "", f"{len(new)} new in {vb}" if new else "",
             f"{len(moved)} with another count" if moved else ""]
    return f"transformers {vb} against {va}: " + ", ".join(x for x in parts if x)


def _syncs_per_run(model, ids, mask, new_tokens, deferred) -> dict:
    """One profiled ``generate()``: its tokens, the trace's syncs by name, the host's time inside them per new
    token, and the GPU's idle share (no kernel running) over the call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("09_stop"):
            out = greedy(model, ids, mask, new_tokens, deferred=deferred)
        torch.cuda.synchronize()
    events = _trace(prof)
    r0, r1 = next((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("name") == "09_stop" and str(e.get("cat", "")).lower() == "user_annotation")
    syncs = [e for e in events if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver")
             and r0 <= float(e["ts"]) <= r1 and _is_sync(str(e["name"]))]
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if str(e.get("cat", "")).lower() == "kernel"]
    return {"tokens": out.tolist(), "syncs": dict(Counter(str(e["name"]) for e in syncs)),
            "wait_us_per_token": sum(float(e["dur"]) for e in syncs) / new_tokens,
            "gpu_idle": idle_share(kernels, r0, r1) if kernels else None}


def stop_checks(new_tokens: int = 24, batch: int = 2, rounds: int = 5, seed: int = 0, gpu_ms: float = 0.0) -> dict:
    """GPU: transformers' default stop check against the deferred one (transformers' own
    ``DeferredStopCheck`` turned on for CUDA where the installed version has it, else the course's):
    the tokens, the trace's syncs by name, the host's time waiting in them and the GPU's idle share, and
    tokens per second (median of ``rounds`` interleaved rounds, and each round's ratio). ``gpu_ms`` > 0
    adds that much GPU work at the start of every forward (:func:`pinlab.gpu_busy` in a forward pre-hook):
    a stand-in for a model whose step keeps the GPU busy about as long as the host's own work."""
    new_tokens, batch, rounds, seed, gpu_ms = _stop_args(new_tokens, batch, rounds, seed, gpu_ms)
    require_cuda("stop_checks()")
    from transformers.generation import utils as gu

    use = "transformers" if hasattr(gu, "DeferredStopCheck") and hasattr(gu.DeferredStopCheck, "is_supported") \
        else "course"
    model = tiny_llama("cuda", seed)
    if gpu_ms:
        model.register_forward_pre_hook(lambda module, args: gpu_busy(gpu_ms))
    ids, mask = prompt(batch, seed=seed, device="cuda")
    modes = {"default": None, "deferred": use}
    out = {"deferred_is": "transformers' DeferredStopCheck" if use == "transformers" else "the course's DeferredStop",
           "transformers": require_transformers("stop_checks()").__version__, "gpu_ms": gpu_ms, "runs": {}}
    for name, d in modes.items():  # warm-up
        greedy(model, ids, mask, new_tokens, deferred=d)
    torch.cuda.synchronize()
    for name, d in modes.items():
        out["runs"][name] = _syncs_per_run(model, ids, mask, new_tokens, d)
    def one(name, _round):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        greedy(model, ids, mask, new_tokens, deferred=modes[name])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = interleaved(list(modes), rounds, one)  # the order rotates each round
    tokens = batch * new_tokens
    for name in modes:
        out["runs"][name]["tokens_per_s"] = tokens / statistics.median(times[name])
    out["ratios"] = [a / b for a, b in zip(times["default"], times["deferred"])]  # deferred's speed-up per round
    return out


def speedup(result: dict) -> float:
    """The deferred check's tokens per second over the default's, in one :func:`stop_checks` result."""
    r = result["runs"]
    return r["deferred"]["tokens_per_s"] / r["default"]["tokens_per_s"]


def stop_checks_text(results: dict) -> str:
    """One sentence on what deferring the stop check bought, computed from :func:`stop_checks` results named by
    what they ran (``{label: result}``): its speed-up, the host's waits and the GPU's idle share in each, and the
    cudaStreamSynchronize calls the deferred run still made (the mask builder's, where it syncs every token)."""
    parts = []
    for label, res in results.items():
        d, n = res["runs"]["default"], res["runs"]["deferred"]
        idle = ("" if d["gpu_idle"] is None or n["gpu_idle"] is None
                else f", the GPU idle {d['gpu_idle']:.0%} -> {n['gpu_idle']:.0%} of the call")
        still = n["syncs"].get("cudaStreamSynchronize", 0)
        parts.append(f"{label} (transformers {res['transformers']}): {speedup(res):.2f}x, the host waiting "
                     f"{d['wait_us_per_token']:.0f} -> {n['wait_us_per_token']:.0f} us per token{idle}, "
                     f"{still} cudaStreamSynchronize left in the deferred run")
    return "; ".join(parts)


#: the stop-check sweep (:func:`stop_check_sweep`): batch sizes, and the GPU work added to every forward (0: the
#: tiny model as it is; 4 ms: far more GPU work per step than the host's; each run's GPU idle share says which
#: side set the pace)
SWEEP_BATCHES = (1, 8, 64)
SWEEP_GPU_MS = (0.0, 4.0)


def _sizes(name: str, values, check) -> list:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__") or not list(values):
        raise TypeError(f"{name} must be a non-empty list, such as {list(SWEEP_BATCHES)}, got {values!r}"[:200])
    return [check(f"{name}[{i}]", v) for i, v in enumerate(values)]


def stop_check_sweep(batches=SWEEP_BATCHES, gpu_ms=SWEEP_GPU_MS, new_tokens: int = 24, rounds: int = 5,
                     seed: int = 0) -> dict:
    """GPU: :func:`stop_checks` at every batch size of ``batches`` for every ``gpu_ms``. Each result keeps
    ``same_tokens`` (the two stop checks decoded the same) instead of the tokens. Returns ``{"batches",
    "gpu_ms", "new_tokens", "rounds", "results": {"<gpu_ms>": {"<batch>": result}}}``."""
    batches = _sizes("batches", batches, lambda n, v: positive_int(n, v, maximum=MAX_BATCH))
    gpu = _sizes("gpu_ms", gpu_ms, lambda n, v: positive_number(n, v, allow_zero=True, maximum=100.0))
    new_tokens, _, rounds, seed, _ = _stop_args(new_tokens, 1, rounds, seed, 0.0)
    require_cuda("stop_check_sweep()")
    out = {"batches": batches, "gpu_ms": gpu, "new_tokens": new_tokens, "rounds": rounds, "results": {}}
    for ms in gpu:
        per = out["results"][f"{ms:g}"] = {}
        for b in batches:
            res = stop_checks(new_tokens, b, rounds, seed, ms)
            runs = res["runs"]
            res["same_tokens"] = runs["default"].pop("tokens") == runs["deferred"].pop("tokens")
            per[str(b)] = res
    return out


def _workload(ms: str) -> str:
    return "tiny model" if float(ms) == 0 else f"+{ms} ms GPU per step"


def _share(x) -> str:
    return "no kernel in the trace" if x is None else f"{x:.0%}"


#: the columns of the notebook's sweep table (rows: :func:`sweep_rows`)
SWEEP_COLUMNS = [("workload", "workload"), ("batch", "batch"), ("default", "default tok/s"),
                 ("deferred", "deferred tok/s"), ("ratio", "deferred/default (rounds' range)"),
                 ("wait", "host wait us/token"), ("idle", "GPU idle")]


def sweep_rows(sweep: dict) -> list[dict]:
    """One row per workload and batch size of :func:`stop_check_sweep`: tokens per second of both stop checks,
    the deferred one's ratio (of the medians; the range of the rounds' ratios), the host's wait per token and the
    GPU's idle share, default -> deferred."""
    rows = []
    for ms, per in sweep["results"].items():
        for b, r in per.items():
            d, n = r["runs"]["default"], r["runs"]["deferred"]
            rows.append({"workload": _workload(ms), "batch": int(b), "default": f"{d['tokens_per_s']:.0f}",
                         "deferred": f"{n['tokens_per_s']:.0f}",
                         "ratio": f"{speedup(r):.2f}x ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})",
                         "wait": f"{d['wait_us_per_token']:.0f} -> {n['wait_us_per_token']:.0f}",
                         "idle": f"{_share(d['gpu_idle'])} -> {_share(n['gpu_idle'])}"})
    return rows


def sweep_text(sweep: dict) -> str:
    """One sentence per workload of :func:`stop_check_sweep`, computed from it: the GPU's idle share under the
    default check from the smallest to the largest batch, and where the deferred check's every round was faster
    (its whole range above 1), slower (below 1), or neither."""
    parts = []
    for ms, per in sweep["results"].items():
        bs = sorted(per, key=int)
        lo, hi = per[bs[0]]["runs"]["default"]["gpu_idle"], per[bs[-1]]["runs"]["default"]["gpu_idle"]
        faster = [b for b in bs if min(per[b]["ratios"]) > 1.0]
        slower = [b for b in bs if max(per[b]["ratios"]) < 1.0]
        verdict = (f"every round faster at batch {', '.join(faster)}" if faster else "no batch size where every "
                   "round was faster")
        if slower:
            verdict += f"; every round slower at batch {', '.join(slower)}"
        parts.append(f"{_workload(ms)}: GPU idle share of the call (default check) {_share(lo)} at batch {bs[0]}, "
                     f"{_share(hi)} at {bs[-1]}; deferred: {verdict}")
    return "; ".join(parts)


def plot_sweep(sweep: dict, *, title: str):
    """Top: tokens per second against the batch size; bottom: the GPU's idle share of the call; one line per
    workload and stop check (deferred dashed), batch sizes on a log axis."""
    import matplotlib.ticker

    from ..plots import color_for, legend_outside, stacked

    fig, (a1, a2) = stacked(2, height=3.2, sharex=True)
    for ms, per in sweep["results"].items():
        bs = sorted(per, key=int)
        for check, style in (("default", "-"), ("deferred", "--")):
            label = f"{_workload(ms)}, {check}"
            runs = [per[b]["runs"][check] for b in bs]
            xs = [int(b) for b in bs]
            a1.plot(xs, [r["tokens_per_s"] for r in runs], style, marker="o", ms=4, label=label,
                    color=color_for(_workload(ms)))
            idle = [(int(b), r["gpu_idle"] * 100) for b, r in zip(bs, runs) if r["gpu_idle"] is not None]
            a2.plot([x for x, _ in idle], [y for _, y in idle], style, marker="o", ms=4, label=label,
                    color=color_for(_workload(ms)))
    a1.set_xscale("log", base=2)
    sizes = sorted({int(b) for per in sweep["results"].values() for b in per})
    a2.set_xticks(sizes, [str(b) for b in sizes])
    a2.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a1.set_yscale("log")
    a1.set_ylabel("tokens per second")
    a2.set_ylabel("GPU idle, % of the call")
    a2.set_ylim(0, 100)
    a2.set_xlabel("batch size (prompts)")
    for ax in (a1, a2):
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(a2, ncols=2)
    fig.suptitle(title)
    return a1, a2


def race_ring(stream, slots: int, steps: int = 16, busy_ms: float = 1.0) -> dict:
    """The deferred stop check in a plain loop on ``stream``: each step the GPU works ``busy_ms`` (the
    step's forward: a wide lead over the host's microseconds), updates ``unfinished`` and the check
    copies its flag; run under ``detect_races``. Returns the findings by kind and the
    decisions (which step each check saw stop)."""
    from ..races import detect_races

    if stream is None:
        raise TypeError("stream must be a pinlab stream (pinlab.stream() or pinlab.LaggingStream()), got None")
    stream = cuda_or(stream, "race_ring()")
    steps = positive_int("steps", steps, maximum=MAX_STEPS)
    slots = positive_int("slots", slots, maximum=MAX_SLOTS)
    busy_ms = positive_number("busy_ms", busy_ms, maximum=1000.0)
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


def audit_flashinfer(steps: int = 8, batch: int = 16, seed: int = 0) -> dict:
    """GPU: ``steps`` decode steps of FlashInfer's wrapper (``plan()`` then ``run()``, through
    :class:`pinlab.paged_kv.FlashInferDecode`) under detect_stalls and torch.profiler, every detector event
    matched with the trace as in :func:`audit_generate`. The plan inputs ``indptr`` and ``last_page_len`` are
    pageable host tensors, as vLLM 0.29 passes them (the PR left ``plan()``'s inputs pageable); ``indices`` is
    on the GPU. Returns ``flashinfer`` (its version, or why it is missing), the detector's counts, the places,
    precision and recall, and the trace's H2D copies by name."""
    steps, batch = positive_int("steps", steps, maximum=MAX_STEPS), positive_int("batch", batch, maximum=256)
    seed = _seed(seed)
    require_cuda("audit_flashinfer()")
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..paged_kv import FlashInferDecode, FlashInferUnavailableError, build_metadata, flashinfer_available, \
        random_batch

    ok, reason = flashinfer_available()
    if not ok:
        return {"flashinfer": f"not available: {reason}"}
    import flashinfer

    try:
        dec = FlashInferDecode(8, 2, 128, 16)
        rb = random_batch(batch, 256, 16, 2, 128, 8, seed=seed, device="cuda")
        meta = build_metadata(rb.block_table, rb.seq_lens.clamp(min=1), 16)
        indptr = torch.tensor(meta.indptr_cpu.tolist(), dtype=torch.int32)  # pageable, as vLLM 0.29 passes them
        last = torch.tensor(meta.last_page_len_cpu.tolist(), dtype=torch.int32)
        dec.plan(indptr, meta.indices, last)  # warm-up: JIT build or cache load, every kernel once
        dec.run(rb.q, rb.k_cache, rb.v_cache)
        torch.cuda.synchronize()
    except FlashInferUnavailableError as exc:
        return {"flashinfer": f"not available: {exc}"}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with _det.detect_stalls(max_events=None) as report, _Windows(report) as win:
            with record_function("09_flashinfer"):
                for _ in range(steps):
                    dec.plan(indptr, meta.indices, last)
                    dec.run(rb.q, rb.k_cache, rb.v_cache)
        torch.cuda.synchronize()
    events = _trace(prof)
    m = match(events, win.windows, report.events, "09_flashinfer")
    memcpy = Counter(str(e["name"]) for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"
                     and "HtoD" in str(e["name"]))
    return {"flashinfer": getattr(flashinfer, "__version__", "unknown"), "steps": steps, "batch": batch,
            "counts": dict(report.counts), "places": _places(m.pop("per_event")),
            **{k: (dict(v) if isinstance(v, Counter) else v) for k, v in m.items()}, "memcpy": dict(memcpy)}


#: the three ways two plan() steps meet one pinned workspace in :func:`plan_staging` (lesson 04's children)
STAGING_MODES = ("back_to_back", "two_wrappers", "event_wait")


def plan_staging(busy_ms: float = 50.0, seed: int = 0, tol: float = 0.02, timeout_s: float = 12.0,
                 watchdog_s: float = 3.0, startup_s: float = 600.0) -> dict:
    """FlashInfer's own staging under :func:`pinlab.detect_races`: two decode steps (``plan()`` + ``run()``)
    while the GPU is 50 ms behind, in a child process each (a race here can kill a CUDA context), for
    :data:`STAGING_MODES`: one wrapper with the host ahead, one wrapper per step in flight, and one wrapper
    with the host waiting for the previous step's event before re-planning (lesson 04's children,
    ``l04._plan_hazard_child(..., races=True)``: each ``plan()``'s C++ copy from the wrapper's pinned
    workspace is declared with ``RaceDetector.copied``). Returns ``{mode: outcome}`` (from
    :func:`pinlab.child.classify_child`: ``outcome``, ``detail``, ``races``, ``race_kinds``,
    ``races_elsewhere``, ``seconds``), ``parent_context_ok`` and ``flashinfer`` (its version, or why it
    is missing). CUDA only."""
    from ..paged_kv import flashinfer_available
    from . import l04_the_fix as l04

    busy_ms, seed = positive_number("busy_ms", busy_ms), _seed(seed)
    tol, timeout_s = positive_number("tol", tol), positive_number("timeout_s", timeout_s)
    watchdog_s, startup_s = positive_number("watchdog_s", watchdog_s), positive_number("startup_s", startup_s)
    require_cuda("plan_staging()")
    ok, reason = flashinfer_available()
    if ok:
        import flashinfer

        print("plan_staging: three child processes (one per way of meeting the workspace)...", file=sys.stderr,
              flush=True)
        out = l04.run_children({m: l04.child_code(m, busy_ms, seed, tol, watchdog_s, races=True)
                                for m in STAGING_MODES}, timeout_s, ready_timeout_s=startup_s)
        out["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    else:
        out = {m: {"outcome": "unavailable", "detail": reason, "seconds": 0.0, "returncode": None}
               for m in STAGING_MODES}
        out["flashinfer"] = f"not available: {reason}"
    out["parent_context_ok"] = l04._context_ok()
    out["busy_ms"] = busy_ms
    return out


def staging_text(r: dict) -> str:
    """What :func:`plan_staging`'s run says, in one sentence computed from it."""
    b = r["back_to_back"]
    if b["outcome"] == "unavailable":
        return f"FlashInfer could not run the children here ({b['detail']})."
    seen = b.get("races", 0) - b.get("races_elsewhere", 0)
    return (f"With one wrapper and the host ahead, detect_races flagged the staging {seen} time(s) once it was "
            f"declared, and {b.get('races_elsewhere', 0)} other finding(s) in FlashInfer's torch calls; the "
            f"output was {b['outcome']} ({b['detail']}). One wrapper per step: "
            f"{r['two_wrappers']['outcome']}, {r['two_wrappers'].get('races', 0)} finding(s); waiting on the "
            f"previous step's event: {r['event_wait']['outcome']}, {r['event_wait'].get('races', 0)} finding(s).")


#: the columns of the notebook's table of :func:`plan_staging` (``pinlab.table(l09.staging_rows(r), ...)``)
STAGING_COLUMNS = [("mode", "two steps"), ("outcome", "output"), ("staging", "staging flagged"),
                   ("elsewhere", "other findings"), ("seconds", "s")]


def staging_rows(r: dict) -> list[dict]:
    """One row per mode of a :func:`plan_staging` result."""
    from .l04_the_fix import PLAN_MODES

    return [{"mode": PLAN_MODES[m], "outcome": r[m]["outcome"],
             "staging": r[m].get("races", 0) - r[m].get("races_elsewhere", 0),
             "elsewhere": r[m].get("races_elsewhere", 0), "seconds": r[m].get("seconds", 0.0)}
            for m in STAGING_MODES]


def measure_or_say(name: str, fn, requires=None, **params):
    """:func:`pinlab.replay.measure_if_recorded`: :func:`pinlab.measure`, or None after one sentence where there is
    no CUDA and no recording yet; a broken recording raises :class:`pinlab.replay.ReplayFileError`, naming it."""
    from ..replay import measure_if_recorded

    return measure_if_recorded(name, fn, requires=requires, **params)


class PinWitness:
    """A batch ``(x, y)`` of the custom type DataLoader's docs describe ("Memory Pinning": a type with a
    ``pin_memory()`` method): DataLoader calls that method where it pins, so the batch can say which thread
    pinned it. The loop moves ``batch.x`` and ``batch.y``."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def pin_memory(self):
        _PINNED_BY.append(pinning_thread(threading.current_thread()))
        return PinWitness(self.x.pin_memory(), self.y.pin_memory())


def pinning_thread(thread) -> str:
    """"main thread", "DataLoader's pin_memory thread" (the thread running torch's ``_pin_memory_loop``: its
    Python name is ``Thread-N (_pin_memory_loop)``, N counting the threads made so far) or "another thread"."""
    if thread is threading.main_thread():
        return "main thread"
    return "DataLoader's pin_memory thread" if "_pin_memory_loop" in thread.name else "another thread"


_PINNED_BY: list[str] = []


def collate_witness(samples):
    """Stack the samples into a :class:`PinWitness` (what ``default_collate`` does for a tuple)."""
    xs, ys = zip(*samples)
    return PinWitness(torch.stack(xs), torch.stack(ys))


def collate_strided(samples):
    """The same, keeping every other feature: ``x`` is a strided view (not dense). Its pinned copy keeps
    those strides (``pin_memory`` copies the layout), and torch copies a tensor that is not dense to the
    GPU through a contiguous host temporary: pageable memory (``Copy.cu``, ``copy_requires_temporaries``)."""
    xs, ys = zip(*samples)
    return PinWitness(torch.stack(xs)[:, ::2], torch.stack(ys))


#: the loaders audited: name -> DataLoader options (``collate_fn`` by name)
LOADERS = {
    "pin_memory=False": {"pin_memory": False, "num_workers": 0, "collate_fn": "witness"},
    "pin_memory=True": {"pin_memory": True, "num_workers": 0, "collate_fn": "witness"},
    "pin_memory=True, 2 workers": {"pin_memory": True, "num_workers": 2, "collate_fn": "witness"},
    "pin_memory=True, a strided collate": {"pin_memory": True, "num_workers": 0, "collate_fn": "strided"},
    "pin_memory=True, pin_memory_device='cuda'": {"pin_memory": True, "num_workers": 0, "collate_fn": "witness",
                                                  "pin_memory_device": "cuda"},
}


def audit_dataloader(batches: int = 8, batch_size: int = 4, features: int = 1024) -> dict:
    """GPU: each loader of :data:`LOADERS` over ``batches`` batches of two tensors, each moved with
    ``.to("cuda", non_blocking=True)`` under detect_stalls and torch.profiler: per loader, the detector's
    counts by kind, the trace's H2D copies by name, which thread pinned each batch (:func:`pinning_thread`), and
    the warnings torch's DataLoader gave (those of other code, such as Python's own on ``fork()`` in a process
    with threads, whose text holds a pid, are left out)."""
    batches, batch_size = positive_int("batches", batches), positive_int("batch_size", batch_size)
    features, n = positive_int("features", features), batches * batch_size
    if n * features > 1 << 28:
        raise ValueError(f"batches x batch_size x features must be at most 2**28 floats (1 GiB), got "
                         f"{batches} x {batch_size} x {features}")
    require_cuda("audit_dataloader()")
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(n, features), torch.arange(n))
    collates = {"witness": collate_witness, "strided": collate_strided}
    out = {}
    for name, opts in LOADERS.items():
        opts = dict(opts, collate_fn=collates[opts["collate_fn"]])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(data, batch_size=batch_size, **opts)
            for b in loader:  # warm-up (and the workers' start)
                b.x.to("cuda", non_blocking=True), b.y.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            _PINNED_BY.clear()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with _det.detect_stalls(max_events=None) as report, record_function("09_loader"):
                    moved = 0
                    for b in loader:
                        b.x.to("cuda", non_blocking=True), b.y.to("cuda", non_blocking=True)
                        moved += 2
                torch.cuda.synchronize()
        events = _trace(prof)
        memcpy = Counter(str(e["name"]) for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"
                         and "HtoD" in str(e["name"]))
        out[name] = {"moved": moved, "detector": dict(report.counts),
                     "detector_pageable": report.counts.get(_det.PAGEABLE_H2D, 0),
                     "detector_staged": report.counts.get(_det.NONCONTIG_H2D, 0),
                     "memcpy": dict(memcpy), "pinned_by": dict(Counter(_PINNED_BY)),
                     "warnings": sorted({str(w.message).splitlines()[0][:200] for w in caught
                                         if f"{os.sep}torch{os.sep}" in str(w.filename)})}
    return out


def pageable_copies(case: dict) -> tuple[int, int]:
    """(copies the detector says go through pageable memory, ``Pageable -> Device`` copies in the trace) of
    one loader of :func:`audit_dataloader`: a pageable source, or a pinned one staged through a pageable
    temporary (not dense)."""
    return (case["detector_pageable"] + case.get("detector_staged", 0),
            case["memcpy"].get(PAGEABLE_MEMCPY, 0))


# ---------------------------------------------------------------------------------------------
# the notebook's printed lines (formatting of the results only) and its reasons
# ---------------------------------------------------------------------------------------------


def show_audit(a: dict) -> None:
    """Print one :func:`audit_generate` result: every place (count, kind, file:line, function, code), the host
    waits per new token, the trace's syncs and copies, and the places that wait once per token."""
    show("transformers audited", f"{a['transformers']} (torch {a['torch']})")
    for p in a["places"]:
        show(f"{p['n']:3d} x {p['kind']}", f"{p['where']} in {p['function']}(): {p['code']}")
    show("host waits the detector reports, per new token", f"{waits_per_token(a):.2f}")
    show("cudaStreamSynchronize and other syncs in the trace", a["trace_syncs"])
    show("copies in the trace, by kind", a["memcpy"])
    every = [p for p in a["places"] if p["n"] == a["new_tokens"]]
    show("places that make the host wait once per token",
         "; ".join(f"{p['where']} ({p['function']})" for p in every) or "none")


def show_flashinfer_audit(f: dict) -> None:
    """Print one :func:`audit_flashinfer` result: every place the detector named, per step, and the trace's
    syncs and H2D copies."""
    for p in f["places"]:
        show(f"{p['n']:3d} x {p['kind']}", f"{p['where']} in {p['function']}(): {p['code']}")
    show("events the detector reports, per decode step", f"{f['reported'] / f['steps']:.2f}")
    show("cudaStreamSynchronize and other syncs in the trace", f["trace_syncs"])
    show("copies in the trace, by kind", f["memcpy"] or "none")


def show_comparison(a: dict, b: dict, labels: tuple[str, str] | None = None) -> None:
    """Print two audits side by side (:func:`compare_audits`), their host waits per token and what changed;
    ``labels`` name the two columns (default: their transformers versions)."""
    la, lb = labels or (a["transformers"], b["transformers"])
    rows = compare_audits(a, b)
    if rows:
        table(rows, [("a", la), ("b", lb), ("kind", "kind"), ("function", "function"), ("code", "code")])
    else:
        show(f"places, {la} / {lb}", "none in either audit")
    show(f"host waits per new token, {la} / {lb}", f"{waits_per_token(a):.2f} / {waits_per_token(b):.2f}")
    if a["transformers"] != b["transformers"]:
        show("what changed", changes_text(a, b))


def show_stop_runs(result: dict, new_tokens: int) -> None:
    """Print each run of :func:`stop_checks`: its syncs per token in the trace (by name), the host's time in
    them per token, the GPU's idle share and tokens per second, then the deferred check's speed-up in every
    round."""
    for name in ("default", "deferred"):
        run = result["runs"][name]
        show(f"{name}: syncs per token in the trace", f"{sum(run['syncs'].values()) / new_tokens:.2f} ({run['syncs']})")
        show(f"{name}: host waiting per token, GPU idle share of the call",
             f"{run['wait_us_per_token']:.0f} us, {_share(run['gpu_idle'])}")
        show(f"{name}: tokens per second", f"{run['tokens_per_s']:.0f}")
    show("deferred speed-up per round", ", ".join(f"{x:.2f}x" for x in result["ratios"]))


#: the columns of the notebook's DataLoader table (rows: :func:`loader_rows`)
LOADER_COLUMNS = [("loader", "loader"), ("copies", "copies"), ("detector", "detector: via pageable"),
                  ("pageable", "trace: Pageable -> Device"), ("pinned", "trace: Pinned -> Device"),
                  ("by", "pinned by")]


def loader_rows(cases: dict) -> list[dict]:
    """One table row per loader of :func:`audit_dataloader`: copies made, the detector's and the trace's
    pageable copies, the trace's pinned ones, and who pinned the batches."""
    return [{"loader": name, "copies": c["moved"], "detector": pageable_copies(c)[0],
             "pageable": c["memcpy"].get(PAGEABLE_MEMCPY, 0), "pinned": c["memcpy"].get(PINNED_MEMCPY, 0),
             "by": ", ".join(f"{k} x{v}" for k, v in c["pinned_by"].items()) or "nobody"}
            for name, c in cases.items()]


#: why a claim (or an observed line) of the notebook may not hold on some machine (``why=l09.WHY.name``)
WHY = Reasons(
    no_eos="end-of-sequence is switched off: the length is set by max_new_tokens alone",
    reported="each reported kind (a sync, a blocking copy, a factory of data with elements) makes torch call "
             "cudaStreamSynchronize or cudaMemcpyAsync: the value names how many did not",
    unwatched="ops whose kernel syncs (nonzero, boolean-mask indexing) and torch's own internal calls are outside "
              "what the detector watches; the line above names them",
    same_tokens="the stop decision changes when the host reads it, never what is decoded",
    host_bound="deferring only moves a wait: it pays where no other sync is left in the step and the GPU's work "
               "hides the host's, and by more than the deferred check's own host work per step (a copy, an event, "
               "a wait); the lines above say which part was missing",
    ring="the copy waits behind 1 ms of GPU work while the host reads within microseconds: a wide lead; the 2-slot "
         "ring reads only a slot whose event has completed",
    copy_names="the profiler names every copy by its host memory; the detector reads the source's memory and "
               "layout (a strided pinned tensor goes through a pageable temporary)",
    loaders="8 batches x 2 tensors, each one copy; DataLoader pins in next() without workers and in its pin_memory "
            "thread with them",
    staging_declared="the first plan's copy waits behind 50 ms of GPU work and the second plan() writes the same "
                     "pinned workspace microseconds later: a wide lead; a flag missed means the workspace or its "
                     "plan info moved in this FlashInfer (PLAN_INFO_BYTES in lessons/l04_the_fix.py)",
    staging_fixed="a second wrapper has its own pinned workspace, and after the event wait the first copy has run: "
                  "a wrong output or a finding is a bug in FlashInfer or the driver, or a child that ran out of "
                  "GPU memory beside other processes",
    own_context="the children have their own CUDA contexts; a failure here is a broken driver",
)
