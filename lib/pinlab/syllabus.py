"""The course's syllabus: one table, from which every syllabus in the course is generated.

``LESSONS`` has one row per lesson: its number, file stem (``notebooks/<stem>.ipynb``, exercises in
``exercises/<stem>.ipynb``), title, one-line goal, what it covers, what needs a GPU, the minutes it
takes and what a workshop must land. Generated from it:

- the README's "Syllabus" table and docs/workshop.md's schedules, between ``<!-- syllabus:... -->``
  markers (``python3 tools/syllabus.py --write`` rewrites them; tests/test_syllabus.py checks them);
- notebook 00's syllabus: ``display(Markdown(pinlab.syllabus.markdown()))`` (the site renders it as a table, its
  links to the lessons' pages);
- the course site's landing page (tools/build_site.py loads this file by path: no torch needed).

**The core path.** ``core=True`` marks the lessons a shorter course keeps: 00, 01, 02, 03, 04 and the capstone
(07), which uses what they teach; the others (02b, 05, 06, 08) are deep dives. Every copy of the syllabus says
which lessons are core and gives the core path's total (lessons and their exercises) beside the whole course's,
and docs/workshop.md has an agenda for it (``CORE_WORKSHOP``).

**Minutes are estimated by ``tools/syllabus.py``, not typed in** (``--write`` rewrites ``minutes=`` and
``exercise_minutes=`` below; the test accepts the stored value within one rounding step of the estimate):

    raw = words / 200 (reading at 200 words a minute; every word of the percent source, prose and code)
        + seconds / 60 (the notebook's execution time in reports/gpu/latest.json, the H200 run)
        + 1 per prompt (a 🔮 Predict prompt in a lesson, an exercise in its exercise notebook)
    minutes = raw * CALIBRATION, rounded to 5 (at least 5)

``CALIBRATION`` is fitted (sum of measured / sum of raw) to what learners measured for reading and
running a lesson: about 60 minutes for 01, 90 for 02 and 70 for 04 (``MEASURED``); reading at 200 words a
minute alone underestimates those by about a third (people stop to think and re-read). Exercise minutes
use the same formula on the exercise as a learner sees it (the solutions' bodies left out); no learner
has timed an exercise yet, so treat them as the least certain numbers here.

To add a lesson (e.g. 02b, "overlapping copies"): add its ``Lesson`` row in order, put its number in a
``WORKSHOP`` part, run ``python3 tools/syllabus.py --write``.

This module imports nothing from torch or pinlab: the site build loads it on a machine without torch.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Lesson", "LESSONS", "WORKSHOP", "CORE_WORKSHOP", "MEASURED", "lesson", "markdown", "readme_block",
           "workshop_block", "exercise_links", "minutes_text", "core_lessons", "total_minutes", "totals_text"]

#: learners' reading + running times, in minutes (issue "The self-paced path"): the calibration's data
MEASURED = {"01": 60, "02": 90, "04": 70}
WORDS_PER_MINUTE = 200
MINUTES_PER_PROMPT = 1


@dataclasses.dataclass(frozen=True)
class Lesson:
    number: str            # "00", "01", ... ("02b" sorts after "02")
    stem: str              # file stem: notebooks/<stem>.ipynb, exercises/<stem>.ipynb
    title: str
    goal: str              # one line: what a learner can do afterwards
    covers: str            # what it goes through (README and site)
    gpu: str               # what needs a GPU to measure live
    minutes: int           # reading and running the lesson (tools/syllabus.py --write)
    exercise_minutes: int  # its exercise notebook; 0 when it has none (tools/syllabus.py --write)
    lands: str = ""        # workshop: the points the lesson must land
    exercise_lands: str = ""
    core: bool = False     # on the core path (the shorter course); the others are deep dives

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.stem}.ipynb"

    @property
    def exercise(self) -> str | None:
        return f"exercises/{self.stem}.ipynb" if self.exercise_minutes else None


LESSONS: tuple[Lesson, ...] = (
    Lesson("00", "00_start_here", "Start here",
           goal="know what the course measures, how to run it, and what your machine can show",
           covers="what the course is, how to run it, the doctor",
           gpu="no", minutes=15, exercise_minutes=0,
           lands="every number is measured in the run or replayed and labelled; `[timing]`/`[measured]` lines "
                 "are the run's numbers, everything else a checked fact",
           core=True),
    Lesson("01", "01_pinned_memory", "Pinned memory",
           goal="predict what a host-to-device copy costs, by size and by kind of host memory",
           covers="bandwidth 1 KiB–1 GiB, latency floor, cost of pinning, rounding, when not to pin, who pins in "
                  "practice (the DataLoader's pin-memory thread, pinning from several threads)",
           gpu="yes (replayed without)", minutes=80, exercise_minutes=10,
           lands="the copy engine reads only pinned memory; small copies are latency, large ones bandwidth; pin "
                 "what you **reuse** (cold pinning is expensive, and blocks are rounded up to a power of two); in "
                 "practice a DataLoader's pin-memory thread pins for you",
           core=True),
    Lesson("02", "02_fake_non_blocking", "Fake `non_blocking`: when a copy returns",
           goal="tell when `non_blocking=True` really returns at once, and find the copies that wait",
           covers="when a copy really is asynchronous, the driver's staging pool, D2H, hidden syncs, the same code "
                  "on `pinlab.stream()` (the emulated lagging stream without a GPU), the advice "
                  "\"`non_blocking=True` regardless\" tested",
           gpu="yes (replayed without)", minutes=70, exercise_minutes=15,
           lands="`non_blocking=True` from pageable memory is a request, honoured only while the driver can stage "
                 "the copy (two limits: one per copy, one on pending bytes); a D2H copy into pinned memory is valid "
                 "only after its event; hidden syncs hide in ordinary-looking lines",
           exercise_lands="fix a step's three hidden syncs (exercise 02 covers lessons 02 and 02b)",
           core=True),
    Lesson("02b", "02b_overlapping_copies", "Overlapping copies",
           goal="overlap copies with compute on a second stream, and find the stalls that remain",
           covers="a profiler timeline of a step loop, a copy stream beside the compute (`wait_stream`, "
                  "`record_stream`), many tensors and one sync, `async_tensor_h2d`, a stall detector",
           gpu="yes (replayed without)", minutes=65, exercise_minutes=0,
           lands="copies overlap compute only from pinned memory on a second stream (`wait_stream`, "
                 "`record_stream`); many small tensors: one slab, one sync; `detect_stalls()` finds what "
                 "`set_sync_debug_mode(\"warn\")` misses"),
    Lesson("03", "03_the_race", "The race",
           goal="see a reused pinned buffer deliver a later step's data, silently",
           covers="a reused pinned buffer, a CPU running ahead, FlashInfer decode attending the wrong pages, where "
                  "the host waits in a step that copies from pageable memory",
           gpu="yes (replayed without; FlashInfer where installed, a torch reference otherwise)",
           minutes=70, exercise_minutes=15,
           lands="a pinned source is read when the copy **runs**; a reused pinned buffer with a host that runs ahead "
                 "delivers a later step's data, silently; in FlashInfer decode that is attention over the wrong pages",
           exercise_lands="make a step loop race-free without blocking the host",
           core=True),
    Lesson("04", "04_the_fix", "The fix",
           goal="choose between a pageable buffer, a pin snapshot and an event-guarded pinned ring",
           covers="pin snapshots, why they are safe, the `pin_memory()` trap, the soak's slow steps tamed (warming, "
                  "`pinned_reserve_segment_size_mb`), several tensors sharing the staging pool, the history of fixes "
                  "compared, a pinned slab ring (one copy per step, no allocator call), which fix when",
           gpu="yes (replayed without; FlashInfer where installed, a torch reference otherwise)",
           minutes=70, exercise_minutes=15,
           lands="a `pin_memory()` snapshot of a **pageable** buffer is asynchronous and race-free because the caching "
                 "host allocator holds each block until its copy's event; `pin_memory()` of a pinned tensor is the "
                 "same tensor; its slow steps are cold `cudaHostAlloc`s (warm the cache or reserve a segment); which "
                 "fix when: a pageable buffer for a few small tensors, the snapshot once a step's tensors reach the "
                 "staging pool's size, a pinned slab ring guarded by events when host time per step matters",
           exercise_lands="write `pin_snapshot` (the already-pinned case too); a ring of pinned buffers is safe only "
                          "as deep as the steps in flight, or guarded by events",
           core=True),
    Lesson("05", "05_pinned_weight_restore", "Restoring offloaded weights straight into pinned memory",
           goal="bring weights back from the GPU in one copy, and know what that costs in pinned host RAM",
           covers="`.to(\"cpu\")` vs `.to(\"cpu\").pin_memory()` vs `empty_like(pin_memory=True).copy_()`, restore "
                  "bandwidth vs the D2H peak, pinned footprint (power-of-two rounding), reload behind a busy GPU, "
                  "sleep/wake 64 MiB–3 GiB, zero-copy",
           gpu="yes (replayed without; round trips emulated)", minutes=45, exercise_minutes=10,
           lands="restore with **one copy straight into pinned memory** "
                 "(`torch.empty_like(p, device=\"cpu\", pin_memory=True).copy_(p)`), never `.to(\"cpu\")` then "
                 "`.pin_memory()`; the price is pinned host RAM, rounded up per weight; sleep/wake runs near the "
                 "link's rate once the allocator is warm"),
    Lesson("06", "06_device_side_indices", "Build indices on the device",
           goal="build index tensors where they are used instead of copying them, when that is cheaper",
           covers="Qwen2-VL rotary position ids three ways (CPU + copy, per image on the device, vectorised), "
                  "launches and copies counted with the profiler, a builder chosen per batch; a streaming audio "
                  "mask; pinned D2H results read after their event",
           gpu="yes (replayed without; equivalence and the D2H loop run live)", minutes=40, exercise_minutes=15,
           lands="indices that depend only on shapes can be built where they are used; a per-image chain of "
                 "launches can cost more than the copy it removed; build for all images at once, and choose per "
                 "batch from measurements"),
    Lesson("07", "07_capstone_audit", "Capstone: audit an inference loop",
           goal="find and fix the copy problems of a small inference loop, and prove the fix",
           covers="a decoder over a paged KV cache, an offloaded LM head, a vision encoder, with five planted "
                  "problems from the lessons; find them with `detect_stalls` and the profiler, fix them, compare "
                  "steps per second before and after",
           gpu="yes (replayed without; the loops run on the emulated stream)", minutes=45, exercise_minutes=10,
           lands="audit each copy: where its source lives, who rewrites it and when, when its result is read",
           exercise_lands="`pin_memory()` of a pinned buffer is that buffer; a sync after the racing write protects "
                          "nothing; in the fixed loop the only waits left are the events that bound run-ahead; prove "
                          "the fix with the checker (1000 steps), steps per second and a timeline",
           core=True),
    Lesson("08", "08_cuda_graphs", "CUDA graphs: what a captured copy reads",
           goal="stage a CUDA graph's inputs so that every replay reads its own step's data",
           covers="capture and replay, host time per step (eager launches against one replay), what a capture "
                  "refuses (pageable copies, `.item()`), the race under replay, every way to feed a graph's static "
                  "inputs and its host cost, FlashInfer's CUDA-graph decode wrapper (`plan()` outside the graph, "
                  "`run()` captured), a regression test, when graphs help less and the memory they hold",
           gpu="yes (replayed without; the race and the regression test run on the emulated stream; FlashInfer "
               "where installed)", minutes=40, exercise_minutes=10,
           lands="a graph replays the **addresses** it captured: a captured copy from a reused pinned buffer reads "
                 "it when the replay runs; a capture refuses pageable copies, so graphs push staging into pinned "
                 "memory; fill static inputs from memory nobody rewrites before its copy has run (a `pin_memory()` "
                 "snapshot outside the graph, or an event-guarded ring); FlashInfer's `plan()` outside the graph "
                 "needs the same fix",
           exercise_lands="make a step capturable (device work only, no `.item()`); stage a captured step's inputs "
                          "without a race and without waiting for the GPU"),
    Lesson("09", "09_real_code", "Audit real code: HF transformers generate(), a DataLoader, FlashInfer",
           goal="audit code you did not write: name each host sync of a library by file:line and confirm it in "
                "the trace",
           covers="HF `generate()` on a tiny random Llama under `detect_stalls` and the profiler, matched call by "
                  "call (precision and recall; empty `torch.tensor([], device=...)` copies nothing), a deferred stop "
                  "check (two pinned slots and an event; one slot races), a DataLoader's `pin_memory` against the "
                  "trace, FlashInfer's plan() staging under `detect_races` (declared with `copied`; two fixes)",
           gpu="yes (replayed without; the deferred check's tokens and the ring's races run on the emulated stream)",
           minutes=40, exercise_minutes=10,
           lands="`generate()` waits for the GPU every token (the stop check's `bool()`, the mask builder's "
                 "`fast_all`); a flag read one step late from a ring of two pinned slots removes the stop check's "
                 "wait with the same tokens, and whether that buys tokens per second is measured, not assumed; "
                 "count against the trace before trusting a count",
           exercise_lands="`x in gpu_tensor` and `torch.equal` of GPU tensors are `.item()` in disguise; fix a "
                          "user-style decode loop with a deferred stop check (two pinned slots, the previous step's "
                          "event), the same tokens, the stop at most one step late, 0 races"),
)

#: workshop agendas (docs/workshop.md): each part lists lesson numbers, "ex NN" (lesson NN's exercise),
#: ("break", minutes) or ("wrap-up", minutes); start times and totals are computed from the minutes above
WORKSHOP: tuple[tuple[str, tuple], ...] = (
    ("Part one: lessons 00-03", ("00", "01", "ex 01", "02", "02b", "ex 02", ("break", 15), "03", "ex 03")),
    ("Part two: lessons 04-08", ("04", "ex 04", "05", "ex 05", ("break", 15), "06", "ex 06", "07", "ex 07",
                                 "08", "ex 08", "09", "ex 09", ("wrap-up", 10))),
)
#: the core path as one session: the core lessons, each with its exercise (tests/test_syllabus.py checks it)
CORE_WORKSHOP: tuple[str, tuple] = (
    "The core path: lessons 00-04 and the capstone",
    ("00", "01", "ex 01", "02", "ex 02", ("break", 15), "03", "ex 03", "04", "ex 04", ("break", 15), "07", "ex 07",
     ("wrap-up", 10)))
_WRAP_UP = "each participant names one copy in their own code to check with `detect_stalls()` and the profiler"


def lesson(number: str) -> Lesson:
    """The row of lesson ``number`` ("01")."""
    for row in LESSONS:
        if row.number == number:
            return row
    raise ValueError(f"no lesson {number!r} in the syllabus (lessons: {', '.join(r.number for r in LESSONS)})")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def minutes_text(row: Lesson) -> str:
    return f"{row.minutes} + {row.exercise_minutes}" if row.exercise_minutes else f"{row.minutes}"


def core_lessons() -> tuple[Lesson, ...]:
    """The lessons of the core path, in order."""
    return tuple(r for r in LESSONS if r.core)


def total_minutes(rows=None) -> int:
    """Minutes of ``rows`` (default: every lesson), lessons and their exercises."""
    return sum(r.minutes + r.exercise_minutes for r in (LESSONS if rows is None else rows))


def _hours(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d}"


def totals_text() -> str:
    """The whole course's time and the core path's, in one sentence."""
    core = core_lessons()
    return (f"About {_hours(total_minutes())} in all; the core path (the lessons marked core: "
            f"{', '.join(r.number for r in core)}) about {_hours(total_minutes(core))}, the others are deep dives.")


def _path(row: Lesson) -> str:
    return "core" if row.core else "deep dive"


def markdown(*, links: bool = True, base: str = "") -> str:
    """The syllabus as a Markdown table: lesson, title and goal, minutes (lesson + exercise), GPU.

    ``base`` prefixes each link: "" from inside ``notebooks/`` (notebook 00), "notebooks/" from the top.
    """
    lines = ["| lesson | what you learn | minutes (lesson + exercise) | needs a GPU to measure live | path |",
             "|---|---|---|---|---|"]
    for row in LESSONS:
        num = f"[{row.number}]({base}{row.stem}.ipynb)" if links else row.number
        lines.append(f"| {num} | **{_cell(row.title)}**: {_cell(row.goal)} | {minutes_text(row)} | {_cell(row.gpu)} "
                     f"| {_path(row)} |")
    lines.append("")
    lines.append(f"{totals_text()} Minutes are estimated from reading time, the recorded run time and the prompts, "
                 "calibrated on learners' times (`pinlab/syllabus.py` says how).")
    return "\n".join(lines)


def exercise_links(base: str = "exercises/") -> str:
    return ", ".join(f"[{r.number}]({base}{r.stem}.ipynb)" for r in LESSONS if r.exercise_minutes)


def readme_block() -> str:
    """The README's syllabus (between its markers): the table with what each lesson covers."""
    lines = ["| lesson | topic | minutes (lesson + exercise) | needs a GPU to measure live | path |",
             "|---|---|---|---|---|"]
    for row in LESSONS:
        lines.append(f"| [{row.number}]({row.notebook}) | **{_cell(row.title)}**: {_cell(row.covers)} | "
                     f"{minutes_text(row)} | {_cell(row.gpu)} | {_path(row)} |")
    lines += ["", f"{totals_text()} Minutes are estimated by `tools/syllabus.py` from "
              "reading time (200 words a minute), the recorded GPU run's execution time and one minute per prompt, "
              "calibrated on learners' measured times (`lib/pinlab/syllabus.py` says how).", "",
              f"Exercises with automatic checks: {exercise_links()} (master copies with solutions in `solutions/`)."]
    return "\n".join(lines)


def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


def _item(item) -> tuple[int, str, str]:
    """(minutes, what, points) of one agenda item."""
    if isinstance(item, tuple):
        kind, minutes = item
        return minutes, f"{kind} ({minutes} min)", _WRAP_UP if kind == "wrap-up" else ""
    if item.startswith("ex "):
        row = lesson(item[3:])
        if not row.exercise_minutes:
            raise ValueError(f"WORKSHOP lists {item!r} but lesson {row.number} has no exercise")
        return row.exercise_minutes, f"exercise {row.number} ({row.exercise_minutes} min)", row.exercise_lands
    row = lesson(item)
    return row.minutes, f"{row.number} · {row.title} ({row.minutes} min)", row.lands


def workshop_block() -> str:
    """docs/workshop.md's agendas (between its markers): the whole course in two parts, then the core path in
    one session; start times computed from the minutes."""
    out = []
    for name, items in (*WORKSHOP, CORE_WORKSHOP):
        rows, t = [], 0
        for item in items:
            minutes, what, points = _item(item)
            rows.append(f"| {_clock(t)} | {_cell(what)} | {_cell(points)} |")
            t += minutes
        out += [f"### {name} (about {t // 60} h {t % 60:02d})", "", "| time | what | points it must land |",
                "|---|---|---|", *rows, f"| {_clock(t)} | end | |", ""]
    return "\n".join(out).rstrip()
