"""Reliability of outputs (issue #20): publishing never removes what mlakit did not create, OUT never
overlaps a source, one run per OUT (a lock, tested with two real processes), killed runs' leftovers
are found and removed, published outputs are readable by other accounts."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.io.output_dir import (
    PARTIAL_MARKER,
    OutputBusyError,
    OutputExistsError,
    atomic_output,
    claim_output,
    lock_path,
)
from mlakit.io.work_dir import work_dir_for
from mlakit.pipeline import report as report_module
from mlakit.pipeline import run as run_module
from mlakit.pipeline.api import ConvertOptions, StreamOptions, convert, convert_streaming
from tests.convert_helpers import FAST, fast_args, run

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent


# -- 1. a directory that appears at OUT during a run is never replaced ---------------------------


@pytest.mark.parametrize("driver", ["in-memory", "streaming"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_directory_created_at_out_during_the_run_is_kept(
    tiny_sources, tmp_path, monkeypatch, driver, overwrite
):
    out = tmp_path / "out" / "x"
    real = report_module.write_modeling_code

    def someone_else_writes_out(directory):  # late in the run, after the up-front checks
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("notes")
        real(directory)

    monkeypatch.setattr(report_module, "write_modeling_code", someone_else_writes_out)
    fn = convert if driver == "in-memory" else convert_streaming
    with pytest.raises(OutputExistsError, match="appeared while this run worked|no longer an mlakit output"):
        fn(str(tiny_sources["llama_gqa"]), out, ConvertOptions(**FAST, overwrite=overwrite))
    assert (out / "notes.txt").read_text() == "notes" and sorted(p.name for p in out.iterdir()) == [
        "notes.txt"
    ]


def test_publish_refuses_an_empty_directory_that_appeared(tmp_path):
    """renameat2(RENAME_NOREPLACE): even an empty directory (which a plain rename replaces) is kept."""
    out = tmp_path / "out"
    with claim_output(out, overwrite=False) as claim, pytest.raises(OutputExistsError):  # noqa: PT012
        with claim.staging() as tmp:
            (tmp / "conversion.json").write_text("{}")
            out.mkdir()
            inode = out.stat().st_ino
    assert out.stat().st_ino == inode and list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # staging removed, lock released


# -- 2. OUT overlapping the source ------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside-src", "src-inside"])
def test_output_overlapping_the_source_is_refused(tiny_sources, tmp_path, where, monkeypatch):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_sources["llama_gqa"], src)
    (src / "conversion.json").write_text("{}")  # even if it looks like an earlier output
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    if where == "src-inside":
        src = tmp_path / "models" / "src"
        shutil.move(tmp_path / "src", src)
        out = tmp_path / "models"
    else:
        out = src if where == "same" else src / "converted"
    monkeypatch.setattr(run_module, "open_source", lambda *a: pytest.fail("work began"))
    for pipe in ("in-memory", "streaming"):
        code, text = run(src, out, "--overwrite", "--pipeline", pipe, *fast_args())
        assert code == 1 and "damage the source" in text and str(src) in text and str(out) in text, text
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before


# -- 3. --overwrite replaces only mlakit outputs (or an empty directory) ------------------------


def test_overwrite_refuses_a_directory_that_is_not_an_mlakit_output(tiny_sources, tmp_path):
    out = tmp_path / "data"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "thesis.tex").write_text("years of work")
    for pipe in ("in-memory", "streaming"):
        code, text = run(tiny_sources["llama_gqa"], out, "--overwrite", "--pipeline", pipe, *fast_args())
        assert code == 1 and "not an mlakit output" in text and f"rm -r {out}" in text, text
    assert (out / "sub" / "thesis.tex").read_text() == "years of work"
    code, text = run(tiny_sources["llama_gqa"], tmp_path / "conv", *fast_args(), "--no-verify")
    assert code == 0, text
    result = CliRunner().invoke(
        cli, ["export", str(tmp_path / "conv"), str(out), "--overwrite", "--no-verify", "-q"]
    )
    assert result.exit_code == 1 and "not an mlakit output" in result.output, result.output
    assert (out / "sub" / "thesis.tex").read_text() == "years of work"


# -- 14. one run per OUT: a lock, with two real processes ----------------------------------------

_HOLD = """
import sys, time
from pathlib import Path
from mlakit.pipeline.api import ConvertOptions, convert_streaming
ready = Path(sys.argv[3])
def hold_after_the_first_layer(phase, index):
    if (phase, index) == ("convert", 1):
        ready.write_text("1")
        time.sleep(600)
convert_streaming(sys.argv[1], sys.argv[2], ConvertOptions(**{opts!r}), on_layer=hold_after_the_first_layer)
"""


def _start_holder(src, out, ready, tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(_HOLD.format(opts=FAST))
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(src), str(out), str(ready)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"holder did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return proc


def test_a_second_run_into_the_same_output_is_refused_and_a_stale_lock_recovered(tiny_sources, tmp_path):
    src, out = tiny_sources["llama_gqa"], tmp_path / "out"
    proc = _start_holder(src, out, tmp_path / "ready", tmp_path)
    try:
        holder = json.loads(lock_path(out).read_text())
        assert holder["pid"] == proc.pid
        state = json.loads((work_dir_for(out) / "state.json").read_text())
        for extra in ([], ["--resume"], ["--pipeline", "in-memory"]):
            code, text = run(src, out, *fast_args(), *extra)
            assert code == 1 and "another mla-convert run is writing" in text and str(proc.pid) in text, text
        assert (
            json.loads((work_dir_for(out) / "state.json").read_text()) == state
        )  # the live run is untouched
        with pytest.raises(OutputBusyError):
            claim_output(out).__enter__()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lock_path(out).exists()  # a killed holder leaves the file; the kernel dropped its lock
    report = convert_streaming(str(src), out, ConvertOptions(**FAST), StreamOptions(resume=True))
    assert report["pipeline"]["resumed_from_layer"] == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


# -- 15. kill -9 of an in-memory conversion: the next run finds the partial output and removes it --


def test_killed_in_memory_run_leftover_is_named_and_removed(tiny_sources, tmp_path, caplog):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        from mlakit.pipeline import api as pipeline, report
        def killed(directory):  # the weights are written: a model-sized partial directory
            os.kill(os.getpid(), signal.SIGKILL)
        report.write_modeling_code = killed
        pipeline.convert({str(tiny_sources["llama_gqa"])!r}, {str(out)!r}, pipeline.ConvertOptions(**{FAST!r}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    (partial,) = tmp_path.glob(".out.partial-*")
    assert (partial / PARTIAL_MARKER).is_file() and (partial / "model.safetensors").is_file()
    decoy = tmp_path / ".out.partial-mine"  # same pattern, no marker: not ours
    decoy.mkdir()
    (decoy / "keep.txt").write_text("x")
    with caplog.at_level(logging.WARNING, logger="mlakit.io.output_dir"):
        convert(str(tiny_sources["llama_gqa"]), out, ConvertOptions(**FAST))
    assert not partial.exists() and (decoy / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert any(str(partial) in r.getMessage() and "killed" in r.getMessage() for r in caplog.records)


# -- 16. published outputs carry the umask's normal permissions ---------------------------------


def _modes(directory: Path) -> set[tuple[str, int]]:
    found = {("dir", stat.S_IMODE(directory.stat().st_mode))}
    for p in directory.rglob("*"):
        found.add(("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)))
    return found


def test_published_outputs_are_readable_by_others(tiny_sources, tmp_path):
    old = os.umask(0o022)
    try:
        src = str(tiny_sources["llama_gqa"])
        convert(src, tmp_path / "mem", ConvertOptions(**FAST))
        convert_streaming(src, tmp_path / "stream", ConvertOptions(**FAST))
        with atomic_output(
            tmp_path / "staged", overwrite=False
        ) as tmp:  # export, heal and inspect publish so
            (tmp / "export.json").write_text("{}")
            (tmp / "sub").mkdir()
            (tmp / "sub" / "f").write_text("x")
    finally:
        os.umask(old)
    for name in ("mem", "stream", "staged"):
        assert _modes(tmp_path / name) == {("dir", 0o755), ("file", 0o644)}, name
