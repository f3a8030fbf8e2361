"""`make run`: execute every notebook headless on this machine and render it as HTML.

Executed copies go to build/executed/, HTML to build/html/ with an index page; the committed
notebooks are not touched. On a CUDA machine the experiments run live, elsewhere they replay the
latest recorded GPU run. Ends with a table: notebook, mode, seconds, status.
"""
from __future__ import annotations

import html
import sys
import time

import nbtools

ROOT = nbtools.ROOT
BUILD = ROOT / "build"


def render_html(nb_path, html_path) -> None:
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(nb_path), as_version=4))
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")


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
        if out.exists():
            render_html(out, BUILD / "html" / rel.with_suffix(".html"))
        print(f"{status} ({secs:.1f} s)", flush=True)
        rows.append((rel.as_posix(), mode, secs, status))
    links = "\n".join(
        f"<tr><td><a href='{html.escape(r[0][:-6])}.html'>{html.escape(r[0])}</a></td><td>{html.escape(r[1])}</td>"
        f"<td>{r[2]:.1f}</td><td>{r[3]}</td></tr>" for r in rows)
    (BUILD / "html").mkdir(parents=True, exist_ok=True)
    (BUILD / "html" / "index.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>pinlab course</title>"
        "<h1>Honest host-to-device copies in PyTorch</h1>"
        f"<p>Executed on this machine: {html.escape(mode)}.</p>"
        "<table border=1 cellpadding=4><tr><th>notebook</th><th>mode</th><th>seconds</th><th>status</th></tr>"
        f"{links}</table>\n", encoding="utf-8")
    w = max(len(r[0]) for r in rows)
    print()
    print(f"{'notebook'.ljust(w)}  {'mode'.ljust(len(mode))}  seconds  status")
    for r in rows:
        print(f"{r[0].ljust(w)}  {r[1]}  {r[2]:7.1f}  {r[3]}")
    print(f"\nHTML: {BUILD / 'html' / 'index.html'}")
    return 0 if all(r[3] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
