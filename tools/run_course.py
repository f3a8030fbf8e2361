"""`make run`: execute every notebook headless on this machine and render it as the course site.

Executed copies go to build/executed/; build/html/ is the course site (tools/build_site.py, the
same generator and look as `make site`) showing what ran here, each page saying so at its top,
with a "This run" page: notebook, mode, seconds, status. The committed notebooks are not touched.
On a CUDA machine the experiments run live, elsewhere they replay the latest recorded GPU run.
Ends with the same table in the terminal.
"""
from __future__ import annotations

import datetime as dt
import sys
import time

import build_site
import nbtools

ROOT = nbtools.ROOT
BUILD = ROOT / "build"


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "lib"))
    from pinlab.device import facts

    f = facts()
    mode = f"GPU ({f['gpu']})" if f["cuda_available"] else "CPU replay"
    paths = nbtools.notebook_paths(("notebooks", "solutions"))
    if not paths:
        print("no notebooks found under notebooks/ or solutions/")
        return 1
    print(f"Running {len(paths)} notebooks on this machine: {mode}")
    rows = []
    for i, p in enumerate(paths, 1):
        rel = p.relative_to(ROOT)
        out = BUILD / "executed" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{i}/{len(paths)}] {rel} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        try:
            nbtools.execute(p, out)
            status = "ok"
        except Exception as exc:
            status = "FAILED"
            print(f"\n    {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        secs = time.perf_counter() - t0
        print(f"{status} ({secs:.1f} s)", flush=True)
        rows.append((rel.as_posix(), mode, secs, status))
    site_ok = render_site(mode, rows)
    w = max(len(r[0]) for r in rows)
    print()
    print(f"{'notebook'.ljust(w)}  {'mode'.ljust(len(mode))}  seconds  status")
    for r in rows:
        print(f"{r[0].ljust(w)}  {r[1]}  {r[2]:7.1f}  {r[3]}")
    if site_ok:
        print(f"\nHTML: {BUILD / 'html' / 'index.html'}")
    return 0 if site_ok and all(r[3] == "ok" for r in rows) else 1


def render_site(mode: str, rows: list[tuple]) -> bool:
    """build/html: the course site with this run's executed notebooks and its run table."""
    missing = build_site.missing_packages()
    if missing:
        print(f"\nno HTML: the site generator is not installed ({', '.join(missing)}): "
              f"{sys.executable} -m pip install -e '.[site]'")
        return False
    run = build_site.Run(mode=mode, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
                         rows=[build_site.RunRow(*r) for r in rows], executed_root=BUILD / "executed")
    try:
        build_site.build(BUILD / "html", run=run, strict=False)
    except RuntimeError as exc:
        print(f"\nno HTML: {exc}")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
