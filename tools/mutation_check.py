#!/usr/bin/env python3
"""Plant known bugs in lib/, one at a time, and show which CPU tests catch each.

    .venv/bin/python tools/mutation_check.py            # every mutation, on a copy of the working tree
    .venv/bin/python tools/mutation_check.py --list     # what would be planted
    .venv/bin/python tools/mutation_check.py --only h2d.pin_snapshot_same_storage replay.label_flipped
    .venv/bin/python tools/mutation_check.py --rev HEAD # on a commit instead of the working tree

The working tree is never touched: the files git knows (tracked, and untracked but not ignored)
are copied to a temporary folder (or ``git archive REV`` is unpacked there), each mutation is an
exact text replacement in that copy, and ``pytest -m "not gpu"`` runs the mutation's test files
there with ``PYTHONPATH`` pointing at the copy's ``lib`` and ``PINLAB_FORCE_CPU=1``. A test that
already fails on the unmutated copy is not counted as catching anything.

Only behaviour tests count as catching a mutant. Staleness checks fail for *any* edit of ``lib/``, a
planted bug or a comment alike, so they would "catch" every mutant and prove nothing: the GPU-evidence
hash checks (``tests/test_evidence.py``: ``deps_sha256`` of the notebooks' ``lib/`` files) and the
notebook and packaging hygiene checks (``tests/test_notebooks.py``, ``tests/test_packaging.py``), listed in
``STALENESS_TESTS``, are never run for a mutant and their failures never count. Beyond that list, a
control run makes a *neutral* edit (a comment appended) to every file a mutation touches: a test that
fails on that neutral copy but not on the unmutated one is a staleness check too, and is left out of
what catches a mutant (the report names such tests).

Prints one row per mutation (caught by which tests, or SURVIVED) and exits 1 when a planted bug
survives, 2 when a mutation of a shared module no longer matches the code (update the list
below). A lesson-module mutation that no longer matches is reported as STALE and only fails the
run with ``--strict`` (the lesson modules change often; keep their patterns up to date).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    id: str
    path: str           # file under the repository root
    old: str            # exact text, found exactly once
    new: str
    tests: list[str]    # test files (relative to the root) that should catch it
    what: str           # the planted bug, in words
    shared: bool = True  # a shared module this tool's owner keeps in step (False: a lesson module)
    extra: list[str] = field(default_factory=list)


M = Mutation

#: tests that fail for any edit of lib/ (hashes of sources, notebooks in step with their sources): they never
#: count as catching a mutant (see the module docstring)
STALENESS_TESTS = ("tests/test_evidence.py", "tests/test_notebooks.py", "tests/test_packaging.py")
NEUTRAL_EDIT = "\n# mutation_check: a neutral edit (a comment: no behaviour changes)\n"
MUTATIONS: list[Mutation] = [
    # ---- h2d: the take-home snapshot ------------------------------------------------------------
    M("h2d.pin_snapshot_same_storage", "lib/pinlab/h2d.py",
      "if snapshot_method(t.is_pinned(), t.is_contiguous()) == PIN_MEMORY:",
      "if snapshot_method(False, t.is_contiguous()) == PIN_MEMORY:",
      ["tests/test_h2d.py"], "pin_snapshot of a pinned tensor returns t.pin_memory(): the same storage"),
    M("h2d.snapshot_method_trap", "lib/pinlab/h2d.py",
      "return PIN_MEMORY if (not is_pinned and is_contiguous) else EMPTY_COPY",
      "return PIN_MEMORY if is_contiguous else EMPTY_COPY",
      ["tests/test_h2d.py"], "snapshot_method picks pin_memory() for pinned input (the trap)"),
    M("h2d.stage_reuses_input", "lib/pinlab/h2d.py",
      "if pin_memory and target == t.dtype and t.is_contiguous() and t.is_pinned():",
      "if target == t.dtype and t.is_contiguous():",
      ["tests/test_h2d.py"], "stage_on_host returns the caller's pageable tensor instead of a fresh copy"),
    # ---- replay: where a number came from -------------------------------------------------------
    M("replay.label_flipped", "lib/pinlab/replay.py",
      "        if self.live:\n            return f\"measured now on {gpu}\"",
      "        if True:\n            return f\"measured now on {gpu}\"",
      ["tests/test_replay.py"], "Run.label says 'measured now' for a replayed result"),
    M("replay.tag_flipped", "lib/pinlab/replay.py",
      "return f\"{gpu}, {date}\" if self.live else",
      "return f\"{gpu}, {date}\" if True else",
      ["tests/test_replay.py"], "Run.tag (plot titles) drops 'recorded' for a replayed result"),
    M("replay.params_ignored", "lib/pinlab/replay.py",
      "if stored[\"params\"] != params:", "if False:",
      ["tests/test_replay.py"], "replay accepts a recording made with other parameters"),
    M("replay.shape_unchecked", "lib/pinlab/replay.py",
      "        problem = _problem(stored, path.stem)\n", "        problem = None\n",
      ["tests/test_replay.py", "tests/test_bad_input.py"], "a recorded file of the wrong shape is not rejected"),
    M("replay.nan_accepted", "lib/pinlab/replay.py",
      "    bad = _non_finite(stored)\n", "    bad = None\n",
      ["tests/test_replay.py"], "a recording holding NaN or infinity replays (prints 'nan GB/s')"),
    M("replay.other_experiment_accepted", "lib/pinlab/replay.py",
      "if \"name\" in meta and meta[\"name\"] != name:", "if False:",
      ["tests/test_replay.py"], "another experiment's recording replays under this name (same params)"),
    M("replay.schema_unchecked", "lib/pinlab/replay.py",
      "    if \"schema\" in meta:\n", "    if False:\n",
      ["tests/test_replay.py"], "a recording missing a key of its result replays (KeyError later)"),
    M("replay.no_size_cap", "lib/pinlab/replay.py",
      "        if size > MAX_RECORDED_BYTES:\n", "        if False:\n",
      ["tests/test_replay.py"], "a 600 MiB file is read whole before anything is checked"),
    M("replay.records_into_site_packages", "lib/pinlab/replay.py",
      "if kind in (\"package\", \"none\") or inside is not None:", "if False:",
      ["tests/test_replay.py"], "PINLAB_RECORD=1 writes recordings into an installed package"),
    M("doctor.broken_file_ok", "lib/pinlab/doctor.py",
      "add(\"recorded GPU run\", bool(recorded) and not broken,", "add(\"recorded GPU run\", bool(recorded),",
      ["tests/test_replay.py"], "doctor() says [ok] with a broken recorded file"),
    # ---- detector: whose line a stall is ---------------------------------------------------------------
    M("detector.callers_ignored", "lib/pinlab/detector.py",
      "if code in callers or not code.co_filename.startswith(skip_prefixes):",
      "if not code.co_filename.startswith(skip_prefixes):",
      ["tests/test_detector.py"],
      "detect_stalls(callers=[loop]) is ignored: a loop that lives in pinlab is blamed on whoever called it"),
    # ---- paged_kv: metadata -----------------------------------------------------------------------
    M("paged_kv.num_pages_off_by_one", "lib/pinlab/paged_kv.py",
      "(torch.remainder(s, page_size) != 0).to(torch.int64)", "(torch.remainder(s, page_size) >= 0).to(torch.int64)",
      ["tests/test_paged_kv.py"], "num_pages = seq_len // page_size + 1 (one page too many on full pages)"),
    M("paged_kv.kv_indptr_shifted", "lib/pinlab/paged_kv.py",
      "torch.cumsum(pages, dim=0, out=out[1:])", "torch.cumsum(pages, dim=0, out=out[:-1])",
      ["tests/test_paged_kv.py"], "kv_indptr off by one position (running sum written one slot early)"),
    M("paged_kv.last_page_len_off_by_one", "lib/pinlab/paged_kv.py",
      "torch.where(full, torch.full_like(r, page_size), r)", "torch.where(full, torch.full_like(r, page_size - 1), r)",
      ["tests/test_paged_kv.py"], "last_page_len of a full last page is page_size - 1"),
    M("paged_kv.int32_overflow_silent", "lib/pinlab/paged_kv.py",
      "if out.device.type == \"cpu\" and int(out[-1]) > INT32_MAX:", "if False:",
      ["tests/test_paged_kv.py", "tests/test_bad_input.py"], "kv_indptr wraps past int32 silently"),
    M("paged_kv.indptr_start_unchecked", "lib/pinlab/paged_kv.py",
      "if int(indptr[0]) != 0:", "if False:",
      ["tests/test_paged_kv.py", "tests/test_bad_input.py"], "page_indices accepts an indptr not starting at 0"),
    M("paged_kv.negative_page_ids", "lib/pinlab/paged_kv.py",
      "bad = torch.nonzero((pages < 0) | (pages.to(torch.int64) > INT32_MAX))",
      "bad = torch.nonzero(pages.to(torch.int64) > INT32_MAX)",
      ["tests/test_paged_kv.py", "tests/test_bad_input.py"], "build_metadata returns negative page ids"),
    M("paged_kv.reference_gqa", "lib/pinlab/paged_kv.py",
      "k = k.repeat_interleave(group, dim=1).to(q.device)", "k = k.repeat(1, group, 1).to(q.device)",
      ["tests/test_paged_kv.py"], "reference_decode maps query heads to the wrong kv heads (GQA)"),
    # ---- units ------------------------------------------------------------------------------------
    M("timing.fmt_ms_us_units", "lib/pinlab/text.py",
      "return f\"{ms * 1e3:.1f} µs\"", "return f\"{ms * 1e6:.1f} µs\"",
      ["tests/test_core.py", "tests/test_bad_input.py"], "fmt_ms prints ms * 1e6 as µs"),
    M("timing.fmt_ms_seconds", "lib/pinlab/text.py",
      "return f\"{ms / 1e3:.2f} s\"", "return f\"{ms:.2f} s\"",
      ["tests/test_core.py", "tests/test_bad_input.py"], "fmt_ms prints milliseconds as seconds"),
    M("plots.fmt_bytes_decimal", "lib/pinlab/text.py",
      "n /= 1024", "n /= 1000",
      ["tests/test_plots.py", "tests/test_bad_input.py"], "fmt_bytes divides by 1000 but says KiB/MiB"),
    M("timing.report_negative", "lib/pinlab/timing.py",
      "text = fmt_ms(positive_number(\"value\", value, allow_zero=True))", "text = f\"{float(value):.3g} ms\"",
      ["tests/test_core.py", "tests/test_bad_input.py"], "report() prints a negative or NaN time"),
    # ---- checks core --------------------------------------------------------------------------------
    M("checks.numpy_int_rejected", "lib/pinlab/checks/compare.py",
      "        return as_int(got) == expected", "        return isinstance(got, int) and got == expected",
      ["tests/test_core.py", "tests/test_bad_input.py"], "same_int rejects np.int64(5) (a correct answer)"),
    M("checks.tensor_int_rejected", "lib/pinlab/checks/compare.py",
      "        if kind in (\"i\", \"u\") or (is_float is False", "        if kind in (\"i\", \"u\") or (is_float is None",
      ["tests/test_core.py", "tests/test_bad_input.py"], "as_int rejects torch.tensor(5)"),
    M("checks.long_args_cut", "lib/pinlab/checks/compare.py",
      "        return _ends(value, width, depth) + f\" (len {len(value)})\"",
      "        return text[:width] + \"...\"",
      ["tests/test_core.py", "tests/test_bad_input.py"], "long arguments cut at a width, the last values hidden"),
    M("checks.hint_never", "lib/pinlab/checks/verdict.py",
      "if hint and _FAILURES[name] >= 2:", "if hint and _FAILURES[name] >= 99:",
      ["tests/test_core.py"], "the hint never shows"),
    M("hostmem.pinned_back_to_any", "lib/pinlab/hostmem.py",
      "    if isinstance(baseline, bool) or not isinstance(baseline, numbers.Integral):",
      "    if False:",
      ["tests/test_core.py", "tests/test_bad_input.py"], "pinned_back_to('x') returns False"),
    # ---- lesson modules (read-only for this tool's owner: planted only in the copy) ------------------
    M("steploop.snapshot_reads_reused_buffer", "lib/pinlab/steploop.py",
      "if k in (\"reused_pinned\", \"snapshot_of_pinned\", \"event_wait\"):",
      "if k in (\"reused_pinned\", \"snapshot_of_pinned\", \"event_wait\", \"snapshot\"):",
      ["tests/test_steploop.py", "tests/test_l04.py", "tests/test_l03.py"],
      "the snapshot strategy snapshots a reused pinned buffer (pin_memory() returns it: no snapshot)", shared=False),
    M("steploop.snapshot_is_the_buffer", "lib/pinlab/steploop.py",
      "            return buf.pin_memory()\n", "            return buf\n",
      ["tests/test_steploop.py", "tests/test_l04.py", "tests/test_l03.py"],
      "the snapshot strategy copies from the reused buffer itself", shared=False),
    M("steploop.copies_correct_boundary", "lib/pinlab/steploop.py",
      "return [all(writes[m][0] >= copies[n][1]", "return [all(writes[m][0] > copies[n][1]",
      ["tests/test_steploop.py", "tests/test_checks_l03_l04.py"],
      "copies_correct: a write starting exactly when the copy ends counts as a race", shared=False),
    M("steploop.min_ring_depth_off_by_one", "lib/pinlab/steploop.py",
      "for depth in range(1, steps + 1):", "for depth in range(2, steps + 1):",
      ["tests/test_steploop.py", "tests/test_checks_l03_l04.py"], "min_ring_depth never answers 1", shared=False),
    M("decode_loop.safe_indptr_unclamped", "lib/pinlab/decode_loop.py",
      "ip = row.to(torch.int64).clamp(0, total_pages)", "ip = row.to(torch.int64)",
      ["tests/test_decode_loop.py", "tests/test_l03.py"],
      "safe_indptr lets a raced indptr past total_pages through (an out-of-bounds read on the GPU)", shared=False),
    M("l01.gbps_units", "lib/pinlab/lessons/l01_pinned_memory.py",
      "return nbytes / (ms * 1e-3) / 1e9", "return nbytes / (ms * 1e-3) / 2**30",
      ["tests/test_l01.py", "tests/test_checks_l01.py"], "gbps in GiB/s instead of GB/s", shared=False),
    M("l01.n_half_floor", "lib/pinlab/lessons/l01_pinned_memory.py",
      "if r >= peak / 2)", "if r >= peak // 2)",
      ["tests/test_l01.py", "tests/test_checks_l01.py"], "n_half floors the threshold (max(r) // 2)", shared=False),
    M("l02.first_waiting_size_boundary", "lib/pinlab/lessons/l02_fake_non_blocking.py",
      "        if ms <= limit_ms:\n            break", "        if ms < limit_ms:\n            break",
      ["tests/test_l02.py", "tests/test_checks_l02.py"],
      "first_waiting_size counts exactly limit_ms as waiting", shared=False),
    M("l07.full_wait_accepted", "lib/pinlab/lessons/l07_capstone_audit.py",
      "m.decoded - recorded < 1:", "m.decoded - recorded < 0:",
      ["tests/test_l07.py", "tests/test_checks_l07.py"],
      "a wait on the newest step's event (run-ahead 0, a ring of depth 1) is not recorded", shared=False),
    M("l07.restore_not_required", "lib/pinlab/lessons/l07_capstone_audit.py",
      "        if not self.restored:\n", "        if False:\n",
      ["tests/test_l07.py", "tests/test_checks_l07.py"],
      "a step decoded without a restore of the LM head since the previous one is not recorded", shared=False),
    M("l07.overwritten_read_as_early", "lib/pinlab/lessons/l07_capstone_audit.py",
      "if same and same[0] > n:", "if False:",
      ["tests/test_l07.py", "tests/test_checks_l07.py"],
      "a token slot overwritten by a later step is judged a read before its copy ran", shared=False),
    M("streams.pin_memory_copies_pinned", "lib/pinlab/streams.py",
      "            return t  # torch does the same: no copy, the same storage",
      "            return t.clone()",
      ["tests/test_streams.py", "tests/test_h2d.py", "tests/test_steploop.py"],
      "the emulated pin_memory() of pinned memory copies (hides the trap)", shared=False),
    # ---- claims and the platform probe (issue 28) ---------------------------------------------------
    M("claims.claims_first_only", "lib/pinlab/claims.py",
      "    for key, value in mapping.items():\n        if not verdicts[key]:",
      "    for key, value in list(mapping.items())[:1]:\n        if not verdicts[key]:",
      ["tests/test_claims.py"], "claims() fails only when its first entry does not hold"),
    M("claims.claim_never_fails", "lib/pinlab/claims.py",
      "    if not ok:\n        raise ClaimError(failure_message(text, value, why))",
      "    if False:\n        raise ClaimError(failure_message(text, value, why))",
      ["tests/test_claims.py"], "claim() prints 'text: False' and goes on"),
    M("claims.observe_always_yes", "lib/pinlab/claims.py",
      "    if ok:\n        show(text, f\"yes{shown}\")", "    if True:\n        show(text, f\"yes{shown}\")",
      ["tests/test_claims.py"], "observe() says 'yes' for an expectation that did not hold"),
    M("claims.observe_returns_true", "lib/pinlab/claims.py",
      "(f\"; {why.rstrip('.')}\" if why else \"\"))\n    return ok",
      "(f\"; {why.rstrip('.')}\" if why else \"\"))\n    return True",
      ["tests/test_claims.py"], "observe() returns True when it did not hold (the sentence beside it lies)"),
    M("claims.shown_false_prints", "lib/pinlab/claims.py",
      "    if shown:\n        print(wrapped(f\"{text}: {ok if line is None else line}\"))",
      "    if True:\n        print(wrapped(f\"{text}: {ok if line is None else line}\"))",
      ["tests/test_claims.py"], "claim(..., shown=False) still prints 'text: True' (issue 48)"),
    M("probe.unmet_trace_inverted", "lib/pinlab/probe.py",
      "if requires.get(\"gpu_trace\") and not profiler_records_gpu():",
      "if requires.get(\"gpu_trace\") and profiler_records_gpu():",
      ["tests/test_claims.py"], "unmet() inverted: a profiler that records nothing is taken as met"),
    M("probe.summary_never_shared", "lib/pinlab/probe.py",
      "        if p[\"other_gpu_processes\"]:\n", "        if False:\n",
      ["tests/test_claims.py"], "machine_summary() never says the GPU is shared"),
    # ---- the graph emulation and lesson 08's checkers (issue 28; streams.py planted only in the copy) ----
    M("streams.graph_replay_runs_now", "lib/pinlab/streams.py",
      "            self._stream._queue.append(item)", "            item()",
      ["tests/test_l08.py", "tests/test_checks_l08.py"],
      "an emulated graph's replay runs its work at once instead of queuing it (hides the race)", shared=False),
    M("streams.graph_replays_nothing", "lib/pinlab/streams.py",
      "        self._items = None if self._invalidated else list(s._queue)",
      "        self._items = None if self._invalidated else []",
      ["tests/test_l08.py", "tests/test_checks_l08.py"],
      "an emulated graph records nothing: replay() does no work", shared=False),
    M("checks.l08.first_value_only", "lib/pinlab/checks/l08.py",
      "wrong = [n for n, row in enumerate(seen) if row != step_values(n)]",
      "wrong = [n for n, row in enumerate(seen) if row[:1] != step_values(n)[:1]]",
      ["tests/test_checks_l08.py"], "check_graph_stage compares only element 0 of 16 (half copies pass)",
      shared=False),
    M("checks.l08.ring_not_rerun", "lib/pinlab/checks/l08.py",
      "        if 2 * depth + 4 > run[\"steps\"]:", "        if False:",
      ["tests/test_checks_l08.py"], "a ring deeper than the 60 steps checked is never run until it wraps",
      shared=False),
    M("checks.l08.input_overwrite_unchecked", "lib/pinlab/checks/l08.py",
      "            if after != case:", "            if False:",
      ["tests/test_checks_l08.py"], "a step that overwrites the graph's input ids passes", shared=False),
    M("checks.l08.drained_copies_judged", "lib/pinlab/checks/l08.py",
      "        return bool(self.s.emulated and getattr(self.s, \"_draining\", False))", "        return False",
      ["tests/test_checks_l08.py"], "copies a sync drains on the emulation are judged again (a staged copy counts twice)",
      shared=False),
    M("checks.l08.factories_unwatched", "lib/pinlab/checks/l08.py",
      "        if name in _FROM_DATA:\n            self._judge_from_data(name, args, kwargs, capturing)",
      "        if False:\n            self._judge_from_data(name, args, kwargs, capturing)",
      ["tests/test_checks_l08.py"], "torch.tensor/as_tensor/new_tensor(..., device=) of host data pass",
      shared=False),
    M("checks.l08.host_tensor_unwatched", "lib/pinlab/checks/l08.py",
      "    if \"same device\" in text:", "    if False:",
      ["tests/test_checks_l08.py"], "a host arange used in device work inside the capture passes", shared=False),
    M("checks.l08.pinned_gpu_unwatched", "lib/pinlab/checks/l08.py",
      "            if like_gpu or self.gpu_target(dev):", "            if False:",
      ["tests/test_checks_l08.py"], "torch.empty_like(gpu_tensor, pin_memory=True) passes", shared=False),
    M("checks.l03.waits_timed_under_order", "lib/pinlab/checks/l03.py",
      "    host_ms = (timed or h).host_ms", "    host_ms = h.host_ms",
      ["tests/test_checks_l03_l04.py"], "on CUDA the host's waits are timed in the run the order verdict's hooks "
      "slow down (a correct loop rejected, stop 55 on an H100)", shared=False),
    M("checks.l09.spin_loop_unread", "lib/pinlab/checks/l09.py",
      "        cls.query = _spin_query\n", "",
      ["tests/test_checks_l09.py"], "`while not ev.query(): pass` passes on a GPU that keeps up (the loop never "
      "spins)", shared=False),
    # the race detector (pinlab.races) and its pytest gate
    M("races.done_not_asked", "lib/pinlab/races.py",
      "        if found and not self._capturing:\n            for p in list(found):",
      "        if False:\n            for p in list(found):",
      ["tests/test_races.py"], "a copy that has run is still taken as pending: its buffer's next rewrite is flagged"),
    M("races.d2h_reads_unseen", "lib/pinlab/races.py",
      "        dests = [p for p in touched if p.kind == D2H_READ]\n        if not dests:",
      "        dests = []\n        if not dests:",
      ["tests/test_races.py"], "reads of a pending D2H destination are not judged"),
    M("races.replay_not_followed", "lib/pinlab/races.py",
      "        if entry is None or entry[0] is not graph or not self._modes:",
      "        if True:",
      ["tests/test_races.py"], "a graph replay's captured copies are not followed"),
    M("races.pageable_followed", "lib/pinlab/races.py",
      "        if host.device.type != \"cpu\" or not clock.is_pinned(host):",
      "        if host.device.type != \"cpu\":",
      ["tests/test_races.py"], "a pageable copy (staged at the call) is followed as if its source were read later"),
    M("races.emulated_done_early", "lib/pinlab/races.py",
      "        return index < pushed - waiting",
      "        return index <= pushed - waiting",
      ["tests/test_races.py"], "the emulated clock takes the next queued copy for done"),
    M("races.hooks_kept", "lib/pinlab/races.py",
      "        while _saved:\n            cls, attr, had, old = _saved.pop()",
      "        while False:\n            cls, attr, had, old = _saved.pop()",
      ["tests/test_races.py"], "the graph and stream hooks stay patched after the last detector exits"),
    # issue 48: the report per copy site, the shadow cap's boundary, the layout rule
    M("races.first_site_only", "lib/pinlab/races.py",
      "        key = (kind, copy_where)\n", "        key = kind\n",
      ["tests/test_races.py"],
      "findings are kept per kind, not per copy site: a second racy copy site gets no finding of its own "
      "(its races are counted into the first site's)"),
    M("races.shadow_cap_boundary", "lib/pinlab/races.py",
      "        elif nbytes > self.max_shadow_bytes:", "        elif nbytes >= self.max_shadow_bytes:",
      ["tests/test_races.py"], "an H2D copy of exactly max_shadow_bytes is skipped (unchecked) instead of compared"),
    M("races.d2h_shadow_cap_boundary", "lib/pinlab/races.py",
      "if clock.emulated and nbytes <= self.max_shadow_bytes else None",
      "if clock.emulated and nbytes < self.max_shadow_bytes else None",
      ["tests/test_races.py"],
      "a D2H destination of exactly max_shadow_bytes keeps no shadow: a write outside torch is missed"),
    M("races.shared_record_counts_once", "lib/pinlab/races.py",
      "        for ordinal in self._raced_copies(p):", "        for ordinal in self._raced_copies(p)[:1]:",
      ["tests/test_races.py"], "five pending copies of one unchanged buffer, rewritten, count as one race"),
    M("races.layout_check_dropped", "lib/pinlab/races.py",
      "        if not host_layout_ok(op, host.shape, host.stride(), host.is_contiguous(), dev.shape, dev.stride(),\n"
      "                              src.dtype == dst.dtype):",
      "        if False:",
      ["tests/test_races.py"],
      "a non-contiguous pinned view (torch stages it in a pageable temporary) is followed as pending: "
      "its later rewrite is reported as a race"),
    # the race detector by order (pinlab.order) and the gate that uses it
    M("order.event_sync_not_ordering", "lib/pinlab/order.py",
      "        if ev._mark is not None and ev._stream._capture is None and _active():",
      "        if False:",
      ["tests/test_order.py"], "an event's synchronize() does not order the host: every guarded ring is flagged"),
    M("order.device_wait_orders_host", "lib/pinlab/order.py",
      "            _merge(self._clock(stream), clock)",
      "            _merge(self.host_clock, clock)",
      ["tests/test_order.py"], "a device-side wait_event is taken for a host wait: the race behind it is missed"),
    M("order.storage_not_range", "lib/pinlab/order.py",
      "    if ext[1] <= lo or ext[0] >= hi:\n        return False",
      "    if False:\n        return False",
      ["tests/test_order.py"], "pending copies matched by storage, not byte range: two slots of one tensor race"),
    M("order.writes_judged_by_bytes", "lib/pinlab/order.py",
      "                    kind = p.kind if hit(written) else None  # a write, whether or not it changes the bytes",
      "                    kind = None",
      ["tests/test_order.py"], "a torch write of the bytes already there is not a race"),
    M("order.settle_without_compare", "lib/pinlab/order.py",
      "                try:\n                    self._compare((p,))",
      "                try:\n                    pass",
      ["tests/test_order.py"], "an ordering operation drops the copies it orders without comparing them: a numpy "
                               "or another thread's write before the sync is missed"),
    M("order.merge_forgets_copies", "lib/pinlab/order.py",
      "        p.positions.append((stream, seq, mark, ordinal))",
      "        p.positions = deque([(stream, seq, mark, ordinal)])",
      ["tests/test_order.py"], "copies of the same unchanged bytes merged into one lose the count of copies"),
    M("order.freed_storage_flagged", "lib/pinlab/order.py",
      "                    if p.ref() is None:  # freed: the allocator orders its reuse (this is a new storage)",
      "                    if False:",
      ["tests/test_order.py"], "a pinned block freed and handed out again (the snapshot fix) is taken for a race"),
    M("gate.timing_verdict", "lib/pinlab_pytest.py",
      'verdict = str(item.config.getini("pinlab_races_verdict")).strip() or "order"',
      'verdict = "timing"',
      ["tests/test_order.py"], "the gate judges by timing whatever pinlab_races_verdict says: a latent race passes on a "
                               "GPU that keeps up"),
    M("gate.unittest_ungated", "lib/pinlab_pytest.py",
      "    gate = _gate(item)\n    if gate is None:",
      "    gate = _gate(item) if hasattr(item, 'obj') and not hasattr(item, '_testcase') else None\n    if gate is None:",
      ["tests/test_order.py"], "unittest.TestCase tests run without the gate"),
    M("gate.allow_any_suffix", "lib/pinlab_pytest.py",
      'place.endswith("/" + entry)', "place.endswith(entry)",
      ["tests/test_pytest_plugin.py"], "an allowlist entry matches any suffix (myloader.py:42 for loader.py:42)"),
    # the one copy-call parser (issue 31): every interception site reads non_blocking through it
    M("copyargs.to_non_blocking_keywords_only", "lib/pinlab/copyargs.py",
      "    non_blocking = bool(rest[0]) if rest else bool(kwargs.get(\"non_blocking\", False))",
      "    non_blocking = bool(kwargs.get(\"non_blocking\", False))",
      ["tests/test_copyargs.py", "tests/test_detector.py", "tests/test_l07.py"],
      "x.to(dev, dtype, True) read as a blocking copy by every detector"),
    M("copyargs.copy_non_blocking_keywords_only", "lib/pinlab/copyargs.py",
      "        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get(\"non_blocking\", False))",
      "        non_blocking = bool(kwargs.get(\"non_blocking\", False))",
      ["tests/test_copyargs.py", "tests/test_races.py", "tests/test_streams.py"],
      "copy_(src, True) read as a blocking copy by every detector and the emulated stream"),
    # the empty-factory rule of the stall detector (lesson 09)
    M("detector.empty_factory_reported", "lib/pinlab/detector.py",
      "        if dst_type is None or copies_nothing(data):",
      "        if dst_type is None:",
      ["tests/test_detector.py"], "torch.tensor([], device=...) (copies nothing) is reported as a blocking copy"),
    M("detector.nested_empty_not_empty", "lib/pinlab/detector.py",
      "        return all(isinstance(d, (list, tuple)) and copies_nothing(d) for d in data)",
      "        return not data",
      ["tests/test_detector.py"], "a nested empty list ([[], []]) is not taken for data without elements"),
    # lesson 09's exercise checker
    M("l09.syncs_through_helpers_unseen", "lib/pinlab/checks/l09.py",
      "    _where = l07.LoopAudit._caller_line\n",
      "    pass\n",
      ["tests/test_checks_l09.py"], "a sync made in a helper the loop calls (a stopping criterion's class) is not counted",
      shared=False),
    M("l09.race_not_judged", "lib/pinlab/checks/l09.py",
      "    if race is not None:",
      "    if False:",
      ["tests/test_checks_l09.py"], "a race on the pinned stop flag is not judged", shared=False),
    M("l09.two_steps_late_accepted", "lib/pinlab/checks/l09.py",
      "    if late > 1:",
      "    if late > 2:",
      ["tests/test_checks_l09.py"], "a stop two steps late is accepted", shared=False),
    M("l09.polls_accepted", "lib/pinlab/checks/l09.py",
      "        poll = call.endswith(\"polled\")",
      "        poll = False",
      ["tests/test_checks_l09.py"], "a busy-wait on event.query() is not counted", shared=False),
    M("l09.full_wait_accepted", "lib/pinlab/checks/l09.py",
      "        if poll or recorded == self.model.decoded:",
      "        if poll:",
      ["tests/test_checks_l09.py"], "a wait on the event of the step just queued is not counted", shared=False),
    M("l09.tokens_not_compared", "lib/pinlab/checks/l09.py",
      "    if not torch.equal(got, full[:, :steps]):",
      "    if False:",
      ["tests/test_checks_l09.py"], "changed tokens are accepted", shared=False),
    # issue 48: the stop's lower bound, the tokens' dtype, every case run
    M("l09.one_step_early_accepted", "lib/pinlab/checks/l09.py",
      "    if steps < shape[1]:", "    if steps < shape[1] - 1:",
      ["tests/test_checks_l09.py"], "a decode loop that stops one step before the criterion is met is accepted",
      shared=False),
    M("l09.float_tokens_accepted", "lib/pinlab/checks/l09.py",
      "got.shape[0] != shape[0] or got.dtype != torch.int64:", "got.shape[0] != shape[0]:",
      ["tests/test_checks_l09.py"], "float token ids (torch.equal promotes them) are accepted", shared=False),
    M("l09.first_case_only", "lib/pinlab/checks/l09.py",
      "    for case, succ, start, max_new in cases:", "    for case, succ, start, max_new in cases[:1]:",
      ["tests/test_checks_l09.py"], "only the first case runs: a loop wrong only on the stop by repetition passes",
      shared=False),
    # issue 48: torch.cuda's events and synchronize watched, torch.where(cond) a sync, the forwards counted, races
    # judged by order and told apart by the loop's slots
    M("l09.torch_cuda_unwatched", "lib/pinlab/checks/l09.py",
      "        torch.cuda.Event, torch.cuda.synchronize = self.event_class(event), self.cuda_synchronize\n",
      "        pass\n",
      ["tests/test_checks_l09.py"], "torch.cuda.synchronize() and waits on a torch.cuda.Event() are not seen",
      shared=False),
    M("l09.single_argument_where_no_sync", "lib/pinlab/checks/l09.py",
      "        if name == \"where\" and len(args) == 1 and not kwargs and self._dev(first):",
      "        if False:",
      ["tests/test_checks_l09.py"], "torch.where(cond) (a .nonzero()) is not counted as a host sync", shared=False),
    M("l09.forwards_not_counted", "lib/pinlab/checks/l09.py",
      "    if r[\"forwards\"] > allowed:", "    if False:",
      ["tests/test_checks_l09.py"], "a loop that runs every forward and only drops the tokens after the stop passes",
      shared=False),
    M("l09.races_by_timing", "lib/pinlab/checks/l09.py",
      "from ..order import detect_races\n", "from ..races import detect_races\n",
      ["tests/test_checks_l09.py"], "races judged by timing and by storage: two slots of one pinned tensor are a race",
      shared=False),
    M("l09.two_slots_advised_to_all", "lib/pinlab/checks/l09.py",
      "if r[\"slots\"] > 1 else", "if False else",
      ["tests/test_checks_l09.py"], "a loop with two slots that reads early is told to use two slots", shared=False),
    M("l07.equal_not_a_sync", "lib/pinlab/lessons/l07_capstone_audit.py",
      '               "masked_select", "__contains__", "equal", "allclose", "is_nonzero"}',
      '               "masked_select", "__contains__", "allclose", "is_nonzero"}',
      ["tests/test_checks_l09.py"], "torch.equal of device tensors is not counted as a host sync", shared=False),
    M("gate.allow_by_kind_ignored", "lib/pinlab_pytest.py",
      "        if entry == kind:\n            return True",
      "        if entry == kind:\n            pass",
      ["tests/test_pytest_plugin.py"], "an allowlisted kind still fails the test"),
    M("gate.stalls_never_fail", "lib/pinlab_pytest.py",
      "        if \"stalls\" in self.reports:\n            allow = _allow_list(self.item, \"stalls\")",
      "        if False:\n            allow = _allow_list(self.item, \"stalls\")",
      ["tests/test_pytest_plugin.py"], "problems() ignores the stall detector's findings: the stall gate never fails "
                                      "(issue 48)"),
    # ---- CUDA's rules on the emulated stream, and the checkers of exercises 05-07 (issue 28) ----------------
    M("streams.pin_on_device_allowed", "lib/pinlab/streams.py",
      "        if pin and on_device:\n            raise RuntimeError(PIN_DEVICE_ERROR)",
      "        if False:\n            raise RuntimeError(PIN_DEVICE_ERROR)",
      ["tests/test_streams.py", "tests/test_checks_l05.py"],
      "torch.empty_like(gpu_tensor, pin_memory=True) gets pinned host memory, as CUDA never would"),
    M("streams.cpu_is_the_gpu", "lib/pinlab/streams.py",
      "        if device is self.device:\n            return True",
      "        if device == self.device:\n            return True",
      ["tests/test_streams.py", "tests/test_checks_l05.py", "tests/test_checks_l06.py"],
      "a factory's device=torch.device(\"cpu\") names the emulated GPU"),
    M("checks.default_device_same_name_silent", "lib/pinlab/checks/guard.py",
      "        elif (_device_context() is None) != (self.ctx is None):",
      "        elif False:",
      ["tests/test_checks_core.py", "tests/test_checks_l06.py"],
      "torch.set_default_device(\"cpu\") left set (the emulated GPU's name) is restored without a word"),
    M("l05.pin_on_gpu_undiagnosed", "lib/pinlab/checks/l05.py",
      "                if isinstance(exc, RuntimeError) and PIN_DEVICE_ERROR in str(exc):",
      "                if False:",
      ["tests/test_checks_l05.py"], "CUDA's refusal of pinned GPU memory is reported as a bare exception",
      shared=False),
    M("l06.mixed_devices_unseen", "lib/pinlab/lessons/l06_device_side_indices.py",
      "            if host and any(self._dev(t) for t in tensors):",
      "            if False:",
      ["tests/test_checks_l06.py"],
      "an op given a host table and device tensors (a GPU refuses it) is not recorded", shared=False),
    M("l06.copy_non_blocking_keywords_only", "lib/pinlab/lessons/l06_device_side_indices.py",
      "                self._note_copy(args[1], copy_call(name, args, kwargs).non_blocking, \".copy_()\")",
      "                self._note_copy(args[1], bool(kwargs.get(\"non_blocking\", False)), \".copy_()\")",
      ["tests/test_checks_l06.py"], "copy_(src, True) counted as a blocking copy", shared=False),
    M("l06.default_device_unseen", "lib/pinlab/lessons/l06_device_side_indices.py",
      "        if ctx is not self._ctx and self.default_device is None:",
      "        if False:",
      ["tests/test_checks_l06.py"], "torch.set_default_device inside rot_pos_ids is not recorded", shared=False),
    M("l06.host_ids_copy_accepted", "lib/pinlab/checks/l06.py",
      "    if copied[_tokens(big)] > copied[_tokens(few)]:",
      "    if False:",
      ["tests/test_checks_l06.py"], "ids built on the host and copied once are accepted", shared=False),
    M("l07.contains_not_a_sync", "lib/pinlab/lessons/l07_capstone_audit.py",
      "               \"masked_select\", \"__contains__\", \"equal\", \"allclose\", \"is_nonzero\"}",
      "               \"masked_select\", \"equal\", \"allclose\", \"is_nonzero\"}",
      ["tests/test_checks_l07.py"], "`x in device_tokens` is not a host sync", shared=False),
    M("l07.emit_of_device_tokens_unseen", "lib/pinlab/lessons/l07_capstone_audit.py",
      "        if not self._dev(t):\n            return\n        f = sys._getframe(2)",
      "        if True:\n            return\n        f = sys._getframe(2)",
      ["tests/test_checks_l07.py"], "device tokens handed to m.emit() are not a host sync", shared=False),
    M("l07.cuda_synchronize_unseen", "lib/pinlab/lessons/l07_capstone_audit.py",
      "        self._note(SYNC, \"torch.cuda.synchronize()\", 0)\n", "",
      ["tests/test_checks_l07.py"], "torch.cuda.synchronize() in the loop is not a host sync", shared=False),
    M("l07.to_non_blocking_keywords_only", "lib/pinlab/lessons/l07_capstone_audit.py",
      "        nb = copy_call(name, args, kwargs).non_blocking\n        nbytes = first.numel() * first.element_size()",
      "        nb = bool(kwargs.get(\"non_blocking\", False))\n        nbytes = first.numel() * first.element_size()",
      ["tests/test_l07.py", "tests/test_checks_l07.py"],
      "LoopAudit reads non_blocking from keywords only (x.to(dev, dtype, True) taken for a blocking copy)",
      shared=False),
    M("l07.in_loop_by_count", "lib/pinlab/checks/l07.py",
      "(not in_loop or e.get(\"in_loop\", e[\"count\"] > l07.IN_LOOP))",
      "(not in_loop or e[\"count\"] > l07.IN_LOOP)",
      ["tests/test_checks_l07.py"], "a sync inside the loop passes when it ran at most 8 times (7 syncs pass)",
      shared=False),
    # issue 28: the emulation's exact count of host waits, and the checkers of 02-04 that judge by it
    M("streams.poll_not_a_wait", "lib/pinlab/streams.py",
      "                stream._note_wait(\"poll\")", "                pass",
      ["tests/test_streams.py", "tests/test_checks_l02.py", "tests/test_checks_l03_l04.py"],
      "a loop polling an event's query() is not counted as a host wait"),
    M("streams.idle_sync_is_a_wait", "lib/pinlab/streams.py",
      "                if not isinstance(item, _Mark):  # work the GPU has not run: the host waits for it",
      "                if True:",
      ["tests/test_streams.py", "tests/test_checks_l04.py"],
      "a synchronize() with nothing queued before its mark counts as a host wait"),
    M("streams.spin_forever", "lib/pinlab/streams.py",
      "if self._polled == queue.state() or self._misses > SPIN_LIMIT:", "if self._polled == queue.state():",
      ["tests/test_streams.py"], "a polling loop that queues work between its polls never ends"),
    M("streams.torch_cuda_sync_not_emulated", "lib/pinlab/streams.py",
      "        self._saved_cuda_sync, torch.cuda.synchronize = torch.cuda.synchronize, self._cuda_synchronize()\n",
      "        self._saved_cuda_sync = torch.cuda.synchronize\n",
      ["tests/test_streams.py", "tests/test_checks_l04.py"],
      "torch.cuda.synchronize() inside the block is torch's own (no wait counted; on a CPU torch it raises)"),
    M("steploop.run_ahead_is_a_queue_depth", "lib/pinlab/steploop.py",
      "            until = max(until, copies[n - run_ahead - 1][1])", "            until = max(until, copies[n - run_ahead][1])",
      ["tests/test_steploop.py", "tests/test_checks_l03_l04.py"],
      "the model's run_ahead=k waits for step n-k (run-ahead k - 1, the old misnamed knob)"),
    M("steploop.gate_one_step_short", "lib/pinlab/steploop.py",
      "            self.done[(n - self.run_ahead - 1) % len(self.done)].synchronize()",
      "            self.done[(n - self.run_ahead) % len(self.done)].synchronize()",
      ["tests/test_steploop.py"], "RunAheadGate waits for step n-k: run-ahead k - 1"),
    M("l02.waits_not_counted", "lib/pinlab/checks/l02.py",
      "                waited = s.host_waits - waits_before  # exact", "                waited = 0  # exact",
      ["tests/test_checks_l02.py"], "the emulated verdict ignores the host's waits", shared=False),
    M("l03.gpu_tolerance_on_the_emulation", "lib/pinlab/checks/l03.py",
      "    if explicit or len(slow) > steps // 10:", "    if len(explicit) > steps // 10 or len(slow) > steps // 10:",
      ["tests/test_checks_l03_l04.py"], "20 synchronize() calls in 200 steps pass ('the host never waited')",
      shared=False),
    M("l03.copy_before_write_unchecked", "lib/pinlab/checks/l03.py",
      "            if w[\"seq\"] > c[\"seq\"] and wa < b and a < wb:", "            if False:",
      ["tests/test_checks_l03_l04.py"], "a copy enqueued before its pinned source is written is accepted",
      shared=False),
    M("l03.races_judged_by_timing", "lib/pinlab/checks/l03.py",
      "        if by_order is not None:\n", "        if False:\n",
      ["tests/test_checks_l03_l04.py"],
      "issue 48: race_free_loop is judged by its data alone: behind a GPU that keeps up, the racy loop passes",
      shared=False),
    M("l03.event_before_copy_unchecked", "lib/pinlab/checks/l03.py",
      "        if between and all(x[\"record\"] is None or x[\"record\"][0] < c[\"seq\"] for x in between):",
      "        if False:",
      ["tests/test_checks_l03_l04.py"],
      "issue 48: a ring whose event is recorded before its copy (it guards nothing) is accepted", shared=False),
    M("l03.serial_loop_not_named", "lib/pinlab/checks/l03.py",
      "        if depth <= 1 and len(waited) > steps // 2:", "        if False:",
      ["tests/test_checks_l03_l04.py"],
      "a serial one-buffer loop gets another diagnosis for each way it waits", shared=False),
    M("l04.exact_ring_waits_ignored", "lib/pinlab/checks/l04.py",
      "                if waited_in or timed > waited_limit:", "                if timed > waited_limit:",
      ["tests/test_checks_l04.py"], "a ring that waits every step passes on the emulated stream ('no waiting')",
      shared=False),
    M("l04.wrong_event_accepted", "lib/pinlab/checks/l04.py",
      "    other = [j for j in waits if j not in written]", "    other = []",
      ["tests/test_checks_l04.py"], "a wait on another slot's event (events[(k + 1) % depth]) is not named",
      shared=False),
    M("l04.recycled_snapshot_unseen", "lib/pinlab/checks/l04.py",
      "                m = handed.earlier(snap)\n                if m is not None:",
      "                m = handed.earlier(snap)\n                if False:",
      ["tests/test_checks_l04.py"], "a snapshot recycled while its copy is queued is not named", shared=False),
    M("l04.pool_lookback_64", "lib/pinlab/checks/l04.py",
      "                m = handed.earlier(snap)\n                if m is not None:",
      "                m = handed.earlier(snap)\n                if m is not None and n - m <= SNAPSHOT_AHEAD:",
      ["tests/test_checks_l04.py"],
      "issue 48: pin_snapshot's recycling is looked for only SNAPSHOT_AHEAD (64) steps back: a pool of 128 passes",
      shared=False),
    M("l04.snapshot_races_judged_by_timing", "lib/pinlab/checks/l04.py",
      "        if races.findings:\n            f = races.findings[0]\n",
      "        if False:\n            f = races.findings[0]\n",
      ["tests/test_checks_l04.py"],
      "issue 48: pin_snapshot's step loop is judged by its data alone: behind a GPU that keeps up, a snapshot "
      "written again while its copy is unordered passes", shared=False),
    M("l04.ring_races_judged_by_timing", "lib/pinlab/checks/l04.py",
      "            if races.findings:  # no data corrupted in this run", "            if False:  # no data corrupted in this run",
      ["tests/test_checks_l04.py"],
      "issue 48: ring_stage is judged by its data alone: behind a GPU that keeps up, a ring that never waits passes",
      shared=False),
    M("l04.checker_looks_order_the_host", "lib/pinlab/checks/l04.py",
      "    lagging = getattr(mark, \"_mark\", False)\n", "    return not mark.query()\n",
      ["tests/test_checks_l04.py"],
      "issue 48: the step loop counts its marks with query(), which orders the host: on a GPU that keeps up the "
      "checker's own looks order every copy and hide the races", shared=False),
    M("l04.snapshot_loop_shallow", "lib/pinlab/checks/l04.py",
      "SNAPSHOT_AHEAD = 64\n", "SNAPSHOT_AHEAD = 4\n",
      ["tests/test_checks_l04.py"], "pin_snapshot's loop keeps 4 steps in flight: a pool of 5 passes", shared=False),
    M("l04.copy_before_write_unchecked", "lib/pinlab/checks/l04.py",
      "        if any(e[0] == \"write\" and e[1] == j for e in log[first_copy:]):", "        if False:",
      ["tests/test_checks_l04.py"], "a ring buffer copied out before it is written is accepted", shared=False),
    M("l04.unused_buffers_unchecked", "lib/pinlab/checks/l04.py",
      "            if seldom:\n", "            if False:\n",
      ["tests/test_checks_l04.py"], "a ring that never writes some of its buffers is not named", shared=False),
]


# ----------------------------------------------------------------------------- the copy

def _copy_working_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _copy_rev(dest: Path, rev: str) -> None:
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tar_path = dest / ".archive.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()


def _env(copy: Path) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(copy / "lib"), PINLAB_FORCE_CPU="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1",
               PINLAB_DATA_DIR=str(copy / "reports" / "gpu" / "data"))
    return env


def _failures(junit: Path) -> set[str]:
    """``file.py::test_name[params]`` of every failed or erroring test in a junit XML report."""
    failed = set()
    if not junit.is_file():
        return failed
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").split(".")
            failed.add(f"{module[-1] if module else '?'}.py::{case.get('name')}")
    return failed


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[set[str], str, float]:
    """(failing test ids, pytest's last line, seconds) for ``tests`` in the copy."""
    junit = copy / ".mutation-junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", "--tb=no",
           "-o", "addopts=", f"--junitxml={junit}", *tests]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=copy, env=_env(copy), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"<timeout>"}, f"timed out after {timeout:.0f} s", time.perf_counter() - t0
    failed = _failures(junit)
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode not in (0, 1) and not failed:  # collection error, usage error, crash
        failed.add(f"<pytest exit {out.returncode}>")
    return failed, tail, time.perf_counter() - t0


def _apply(copy: Path, mut: Mutation) -> str | None:
    """Plant ``mut`` in the copy; the original text (to restore), or None when it does not match."""
    path = copy / mut.path
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if text.count(mut.old) != 1:
        return None
    path.write_text(text.replace(mut.old, mut.new), encoding="utf-8")
    return text


def _short(test_id: str) -> str:
    return test_id  # already "file.py::name[params]"


def behaviour_tests(tests: list[str]) -> list[str]:
    """``tests`` without the staleness checks (:data:`STALENESS_TESTS`), which never count as catching."""
    return [t for t in tests if t not in STALENESS_TESTS and Path(t).name not in {Path(s).name for s in STALENESS_TESTS}]


def is_staleness_failure(test_id: str) -> bool:
    """A failing ``file.py::name`` of a staleness check file."""
    return test_id.split("::", 1)[0] in {Path(s).name for s in STALENESS_TESTS}


def neutral_failures(copy: Path, paths: list[str], tests: list[str], timeout: float) -> set[str]:
    """Tests failing with a neutral edit (a comment) appended to every one of ``paths``: checks that any edit
    fails (hashes), which must not count as catching a mutant."""
    originals = {}
    try:
        for rel in paths:
            f = copy / rel
            if f.is_file():
                originals[rel] = f.read_text(encoding="utf-8")
                f.write_text(originals[rel] + NEUTRAL_EDIT, encoding="utf-8")
        failed, _, _ = run_tests(copy, tests, timeout)
    finally:
        for rel, text in originals.items():
            (copy / rel).write_text(text, encoding="utf-8")
    return failed


def caught_by(failed: set[str], baseline: set[str], neutral: set[str]) -> list[str]:
    """The tests that catch a mutant: failing with it, not without it, not with a neutral edit, and not a
    staleness check."""
    return sorted(t for t in failed - baseline - neutral if not is_staleness_failure(t))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--rev", help="mutate this commit (git archive) instead of the working tree")
    ap.add_argument("--strict", action="store_true", help="a stale lesson mutation fails the run too")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="skip the neutral-edit control run (staleness checks beyond STALENESS_TESTS then count)")
    args = ap.parse_args(argv)

    muts = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.id for m in MUTATIONS}
        if unknown:
            ap.error(f"unknown mutation id(s): {', '.join(sorted(unknown))} (see --list)")
        muts = [m for m in MUTATIONS if m.id in args.only]
    if args.list:
        for m in muts:
            print(f"{m.id:42} {'shared' if m.shared else 'lesson'}  {m.what}")
        return 0

    copy = Path(tempfile.mkdtemp(prefix="pinlab-mutants-"))
    try:
        (_copy_rev(copy, args.rev) if args.rev else _copy_working_tree(copy))
        where = subprocess.run([sys.executable, "-c", "import pinlab; print(pinlab.__file__)"], cwd=copy,
                               env=_env(copy), capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(copy)):
            print(f"error: the copy imports pinlab from {where!r}, not from {copy}", file=sys.stderr)
            return 2
        print(f"mutating a copy of {'commit ' + args.rev if args.rev else 'the working tree'} in {copy}")

        test_files = sorted({t for m in muts for t in behaviour_tests(m.tests) if (copy / t).is_file()})
        baseline, tail, secs = run_tests(copy, test_files, args.timeout)
        print(f"baseline (no mutation), {len(test_files)} test files: {tail} ({secs:.0f} s)", flush=True)
        if baseline:
            print("  already failing without a mutation (not counted as catching anything): "
                  + ", ".join(sorted(_short(t) for t in baseline)))
        neutral = set()
        if args.control:
            neutral = neutral_failures(copy, sorted({m.path for m in muts}), test_files, args.timeout) - baseline
            print(f"control (a neutral comment in every mutated file): "
                  f"{len(neutral)} tests fail on it and never count as catching"
                  + (": " + ", ".join(sorted(neutral)) if neutral else ""), flush=True)

        rows = []
        for i, m in enumerate(muts, 1):
            if rows:
                print(f"  [{i - 1}/{len(muts)}] {rows[-1][0].id}: {rows[-1][1]}", flush=True)
            tests = [t for t in behaviour_tests(m.tests) if (copy / t).is_file()]
            if not behaviour_tests(m.tests):
                rows.append((m, "STALE", "no behaviour test listed (staleness checks never count): "
                                         "update tools/mutation_check.py", 0.0))
                continue
            original = _apply(copy, m) if tests else None
            if original is None:
                rows.append((m, "STALE", "pattern or test files not found: update tools/mutation_check.py", 0.0))
                continue
            try:
                failed, tail, secs = run_tests(copy, tests, args.timeout)
            finally:
                (copy / m.path).write_text(original, encoding="utf-8")
            caught = caught_by(failed, baseline, neutral)
            if caught:
                shown = ", ".join(_short(t) for t in caught[:3]) + (f" (+{len(caught) - 3} more)" if len(caught) > 3 else "")
                rows.append((m, "caught", f"{len(caught)} tests: {shown}", secs))
            else:
                rows.append((m, "SURVIVED", f"no test failed ({tail})", secs))
        if rows:
            print(f"  [{len(rows)}/{len(muts)}] {rows[-1][0].id}: {rows[-1][1]}", flush=True)
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)

    width = max(len(m.id) for m, *_ in rows)
    print()
    print(f"{'mutation':<{width}}  {'module':6}  {'verdict':8}  {'s':>4}  caught by")
    for m, verdict, note, secs in rows:
        print(f"{m.id:<{width}}  {'shared' if m.shared else 'lesson':6}  {verdict:8}  {secs:4.0f}  {note}")
        print(f"{'':<{width}}  {'':6}  {'':8}  {'':4}  ({m.what})")
    survived = [m for m, v, *_ in rows if v == "SURVIVED"]
    stale_shared = [m for m, v, *_ in rows if v == "STALE" and m.shared]
    stale_lesson = [m for m, v, *_ in rows if v == "STALE" and not m.shared]
    caught = sum(v == "caught" for _, v, *_ in rows)
    print(f"\n{caught} of {len(rows)} planted bugs caught by CPU tests; {len(survived)} survived; "
          f"{len(stale_shared) + len(stale_lesson)} stale.")
    if survived:
        return 1
    if stale_shared or (args.strict and stale_lesson):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
