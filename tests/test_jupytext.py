"""jupytext.toml pairs notebooks/NN.ipynb with notebooks/src/NN.py (solutions likewise, exercises not), and
what Jupytext writes when JupyterLab saves a notebook is what tools/nbbuild.py reads: the same cells, types,
sources and tags. Skipped where jupytext is not installed (it is in the `test` extra)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import nbtools  # noqa: E402

jupytext = pytest.importorskip("jupytext", reason="jupytext is not installed (pip install -e '.[test]')")
from jupytext.config import load_jupytext_configuration_file  # noqa: E402
from jupytext.paired_paths import paired_paths  # noqa: E402

CONFIG = load_jupytext_configuration_file(str(ROOT / "jupytext.toml"))
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py")) + sorted((ROOT / "solutions" / "src").glob("*.py"))


def _cells(parsed):
    return [(c["cell_type"], c["source"], tuple(c["tags"])) for c in parsed]


def _nb_cells(nb):
    return [(c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]),
             tuple(c.get("metadata", {}).get("tags", []))) for c in nb["cells"]]


@pytest.mark.parametrize("folder, paired", [("notebooks", True), ("solutions", True), ("exercises", False)])
def test_pairs_lessons_and_solutions_with_their_sources_and_not_exercises(folder, paired):
    path = str(ROOT / folder / "01_pinned_memory.ipynb")
    formats = CONFIG.default_formats(path)
    if not paired:
        assert formats is None
        return
    got = {Path(p).relative_to(ROOT).as_posix() for p, _ in paired_paths(path, "ipynb", formats)}
    assert got == {f"{folder}/01_pinned_memory.ipynb", f"{folder}/src/01_pinned_memory.py"}


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_jupytext_and_nbbuild_read_and_write_the_same_cells(src):
    text = src.read_text(encoding="utf-8")
    ours = _cells(nbtools.parse_percent(text))
    nb = jupytext.reads(text, fmt="py:percent")
    assert _nb_cells(nb) == ours, "jupytext reads the source into other cells than nbbuild"
    # a JupyterLab save: the notebook nbbuild built, written back by jupytext with the project's options
    built = nbtools.to_notebook(nbtools.parse_percent(text))
    fmt = {"extension": ".py", "format_name": "percent"}
    CONFIG.set_default_format_options(fmt)
    out = jupytext.writes(jupytext.reads(__import__("json").dumps(built), fmt="ipynb"), fmt=fmt)
    assert not out.startswith("# ---"), "no YAML header in src/ (notebook_metadata_filter)"
    assert _cells(nbtools.parse_percent(out)) == ours


def test_a_save_in_jupyterlab_writes_the_edit_to_src_only(tmp_path):
    """What JupyterLab does on save, through Jupytext's contents manager: the edit lands in src/, nothing
    else in the source changes, and an exercise (not paired) gets no src/."""
    import asyncio
    import shutil

    pytest.importorskip("jupyter_server", reason="jupyter_server is not installed (JupyterLab brings it)")
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

    shutil.copyfile(ROOT / "jupytext.toml", tmp_path / "jupytext.toml")
    for folder in ("notebooks", "exercises"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    # as after a GPU suite run or a pull of GPU evidence: the .ipynb an hour newer than its source
    src, ipynb = tmp_path / "notebooks/src/01_pinned_memory.py", tmp_path / "notebooks/01_pinned_memory.ipynb"
    os.utime(src, (src.stat().st_mtime - 3600, src.stat().st_mtime - 3600))
    os.utime(ipynb, (src.stat().st_mtime + 3600, src.stat().st_mtime + 3600))
    cm = jupytext.build_async_jupytext_contents_manager_class(AsyncLargeFileManager)(root_dir=str(tmp_path))

    async def edit(path):
        nb = (await cm.get(path))["content"]
        nb["cells"][0]["source"] += "\n\nAn edit made in JupyterLab."
        await cm.save({"type": "notebook", "format": "json", "content": nb}, path)

    asyncio.run(edit("notebooks/01_pinned_memory.ipynb"))
    asyncio.run(edit("exercises/01_pinned_memory.ipynb"))
    before = (ROOT / "notebooks/src/01_pinned_memory.py").read_text(encoding="utf-8")
    after = (tmp_path / "notebooks/src/01_pinned_memory.py").read_text(encoding="utf-8")
    assert "# An edit made in JupyterLab." in after
    cells_before, cells_after = nbtools.parse_percent(before), nbtools.parse_percent(after)
    assert cells_after[0]["source"] == cells_before[0]["source"] + "\n\nAn edit made in JupyterLab."
    assert cells_after[1:] == cells_before[1:]
    assert not (tmp_path / "exercises" / "src").exists()
