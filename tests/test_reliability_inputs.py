"""Reliability of inputs (issue #20): resume only from the same source content, non-finite values,
extra/odd tensors, wrong shapes, calibration sizes, full disks, path typos, flag names, early refusals,
and a CLI that answers --help without importing torch."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlakit.data import DataSpecError
from mlakit.io import source
from mlakit.io.source import SourceError
from mlakit.io.work_dir import work_dir_for
from mlakit.io.writer import write_json
from mlakit.options import OptionsError
from mlakit.pipeline import api as pipeline
from mlakit.pipeline import run as run_module
from mlakit.pipeline.api import ConversionError, ConvertOptions, StreamOptions, convert, convert_streaming
from mlakit.pipeline.verify import logit_report
from tests.convert_helpers import FAST, fast_args, run
from tests.tiny_models import save_tiny_source

pytestmark = pytest.mark.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent


def _edit_weights(directory: Path, edit) -> None:
    """Rewrite DIRECTORY's model.safetensors with EDIT(tensors) applied in place."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _copy_source(tiny_sources, tmp_path, family="llama_gqa") -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_sources[family], src)
    return src


class _Stop(RuntimeError):
    pass


# -- 4. resume only from the same source content ----------------------------------------------


def test_resume_refuses_a_source_replaced_by_another_of_the_same_size(tiny_sources, tmp_path):
    src = _copy_source(tiny_sources, tmp_path)

    def stop_after_first_layer(phase, index):
        if (phase, index) == ("convert", 1):
            raise _Stop

    with pytest.raises(_Stop):
        convert_streaming(str(src), tmp_path / "out", ConvertOptions(**FAST), on_layer=stop_after_first_layer)
    size = (src / "model.safetensors").stat().st_size
    other = save_tiny_source("llama_gqa", tmp_path / "other")  # same architecture, same seed ...
    _edit_weights(other, lambda t: t["model.layers.1.mlp.up_proj.weight"].mul_(-1))  # ... one tensor differs
    shutil.copy(other / "model.safetensors", src / "model.safetensors")
    assert (src / "model.safetensors").stat().st_size == size
    with pytest.raises(ConversionError, match="source checkpoint's content changed") as info:
        convert_streaming(str(src), tmp_path / "out", ConvertOptions(**FAST), StreamOptions(resume=True))
    assert str(src.resolve()) in str(info.value)
    assert (work_dir_for(tmp_path / "out") / "state.json").is_file()  # the interrupted run is kept


# -- 5. heal --resume from a work directory made for another model ------------------------------


class _Crash(RuntimeError):
    pass


def test_heal_resume_refuses_another_student_or_teacher(tiny_sources, tmp_path):
    from mlakit.heal import HealError, HealOptions, heal

    teacher = _copy_source(tiny_sources, tmp_path)
    student = tmp_path / "student"
    convert(str(teacher), student, ConvertOptions(dtype="float32", quiet=True, verify=False))
    opts = dict(
        teacher=str(teacher),
        data="random",
        seq_len=8,
        batch_size=2,
        val_sequences=2,
        quiet=True,
        tokens=4 * 8 * 2,
        save_every=2,
    )

    def crash(step):
        if step == 3:
            raise _Crash

    with pytest.raises(_Crash):
        heal(student, tmp_path / "healed", HealOptions(**opts), on_step=crash)
    other = tmp_path / "other-student"
    shutil.copytree(student, other)
    _edit_weights(other, lambda t: t["model.layers.0.self_attn.o_proj.weight"].mul_(0.5))  # same shapes
    with pytest.raises(HealError, match="student: the checkpointed run's was") as info:
        heal(other, tmp_path / "healed", HealOptions(**opts, resume=True))
    assert str(student.resolve()) in str(info.value) and str(other.resolve()) in str(info.value)
    _edit_weights(teacher, lambda t: t["model.norm.weight"].add_(1.0))  # the teacher changed in place
    with pytest.raises(HealError, match="teacher: the checkpointed run's was"):
        heal(student, tmp_path / "healed", HealOptions(**opts, resume=True))


# -- 6. non-finite weights and logits; strict JSON ---------------------------------------------


@pytest.mark.parametrize("value, word", [(float("inf"), "1 infinite"), (float("nan"), "1 NaN")])
@pytest.mark.parametrize("pipe", ["in-memory", "streaming"])
def test_non_finite_source_weight_is_named(tiny_sources, tmp_path, value, word, pipe):
    src = _copy_source(tiny_sources, tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_weights(src, lambda t: t[name].view(-1).__setitem__(3, value))
    code, text = run(src, tmp_path / "out", "--pipeline", pipe, *fast_args())
    assert code == 1 and name in text and word in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()


def test_non_finite_logits_fail_verification_and_json_is_strict(tmp_path):
    want = torch.zeros(1, 4, 8)
    got = want.clone()
    got[0, 1, 2] = float("nan")
    with pytest.raises(ConversionError, match="1 of 32 converted logits are NaN or infinite"):
        logit_report(got, want)
    assert logit_report(want + 1, want)["max_abs_logit_diff"] == 1.0
    with pytest.raises(ValueError, match="JSON"):
        write_json(tmp_path / "r.json", {"max_abs_logit_diff": float("nan")})


# -- 7. known buffers are ignored, unknown tensors named ---------------------------------------


@pytest.mark.parametrize("pipe", ["in-memory", "streaming"])
def test_rotary_buffers_are_ignored_and_unknown_tensors_named(tiny_sources, tmp_path, pipe):
    src = _copy_source(tiny_sources, tmp_path)
    _edit_weights(
        src,
        lambda t: t.update(
            {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.rand(8) for i in range(2)}
        ),
    )
    code, text = run(src, tmp_path / "out", "--pipeline", pipe, *fast_args())
    assert code == 0, text
    _edit_weights(src, lambda t: t.update({"model.layers.0.mlp.adapter.weight": torch.zeros(4, 4)}))
    code, text = run(src, tmp_path / "out2", "--pipeline", pipe, *fast_args())
    assert code == 1 and "model.layers.0.mlp.adapter.weight" in text and "not part of the Llama" in text, text
    assert "Traceback" not in text


# -- 8. wrong-shaped tensors --------------------------------------------------------------------


@pytest.mark.parametrize("pipe", ["in-memory", "streaming"])
def test_wrong_shaped_tensor_is_named_with_both_shapes(tiny_sources, tmp_path, pipe):
    src = _copy_source(tiny_sources, tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_weights(src, lambda t: t.__setitem__(name, t[name][:, :100].contiguous()))
    code, text = run(src, tmp_path / "out", "--pipeline", pipe, *fast_args())
    assert code == 1 and name in text and "(64, 100)" in text and "(64, 128)" in text, text


# -- 9. calibration sizes are checked before any work ---------------------------------------------


@pytest.mark.parametrize(
    "args", [["--calib-samples", 0], ["--calib-samples", -5], ["--calib-seq-len", 1], ["--calib-seq-len", 0]]
)
def test_calibration_sizes_are_checked_before_any_work(tiny_sources, tmp_path, args):
    base = ["--kv-lora-rank", 20, "--rope-dim", 8, "--calib", "random"]
    code, text = run(tiny_sources["llama_gqa"], tmp_path / "out", *base, *args)
    assert code == 2 and args[0] in text and "x>=" in text, text
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OptionsError, match=r"--calib-seq-len \(calib_seq_len\) must be >= 2; got 1"):
        ConvertOptions(**dict(FAST, calib_seq_len=1))  # refused when made, before either pipeline runs
    assert list(tmp_path.iterdir()) == []
    code, text = run(
        tiny_sources["llama_gqa"], tmp_path / "ok", *base, "--calib-seq-len", 2, "--calib-samples", 2
    )
    assert code == 0, text  # the minimum works, in both pipelines' report/recipe writing


# -- 10. a full disk is a clean error -----------------------------------------------------------


def test_full_disk_in_memory_is_a_clean_error(tiny_sources, tmp_path):
    """A real failed write: the file size limit (RLIMIT_FSIZE) makes the weights' write fail as a full
    disk does (Python ignores SIGXFSZ, so the write returns EFBIG)."""
    script = textwrap.dedent(f"""
        import resource, sys
        from mlakit.cli import cli
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, {resource.RLIM_INFINITY}))
        sys.argv = ["mla-convert", "convert", {str(tiny_sources["llama_gqa"])!r}, {str(tmp_path / "out")!r},
                    "--pipeline", "in-memory", "--calib", "random", "-q"]
        cli()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "Traceback" not in proc.stderr
        and "could not write" in proc.stderr
        and "File too large" in proc.stderr
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# -- 11. a mistyped local path is not tried as a hub id -------------------------------------------


def test_mistyped_local_path_is_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(source, "_download", lambda spec: pytest.fail("tried the hub"))
    for spec in ("src/does_not_exist", "./model", "models/a/b", "model.gguf"):
        with pytest.raises(SourceError, match="does not exist: no file or directory"):
            source.resolve_source(spec)
    code, text = run("src/does_not_exist", tmp_path / "out")
    assert code == 1 and "does not exist: no file or directory" in text and "could not fetch" not in text, (
        text
    )


# -- 12. calibration errors name convert's flag ----------------------------------------------------


def test_calibration_errors_name_the_calib_flag(tmp_path):
    fake = SimpleNamespace(spec="m", tokenizer=lambda: object())
    opts = ConvertOptions(calib=str(tmp_path / "missing.txt"))
    with pytest.raises(DataSpecError) as info:
        pipeline.calibration_ids(fake, opts, 96)
    assert "--calib builtin" in str(info.value) and "--data" not in str(info.value)


# -- 13. refusals that used to come after the expensive work ---------------------------------------


def test_gguf_streaming_and_unwritable_output_are_refused_first(tiny_sources, tmp_path, monkeypatch):
    monkeypatch.setattr(source, "_open_gguf", lambda *a: pytest.fail("dequantized the GGUF first"))
    code, text = run("default", tmp_path / "out", "--pipeline", "streaming")
    assert code == 1 and "not a directory of *.safetensors" in text, text
    monkeypatch.setattr(run_module, "open_source", lambda *a: pytest.fail("work began"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, text = run(tiny_sources["llama_gqa"], blocker / "out", "--pipeline", "in-memory")
    assert code == 1 and str(blocker) in text and "not writable" in text, text
    ro = Path("/proc/mlakit-readonly-test/out")  # read-only even for root
    code, text = run(tiny_sources["llama_gqa"], ro, "--pipeline", "in-memory")
    assert code == 1 and "Traceback" not in text and "/proc" in text, text


# -- 17. the CLI answers without importing torch ---------------------------------------------------


def test_cli_import_does_not_import_torch():
    script = textwrap.dedent("""
        import sys
        import mlakit.cli
        from click.testing import CliRunner
        for args in (["--help"], ["convert", "--help"], ["convert", "--bogus"], ["heal", "--help"]):
            CliRunner().invoke(mlakit.cli.cli, args)
        heavy = sorted(m for m in ("torch", "transformers", "safetensors", "numpy") if m in sys.modules)
        print(",".join(heavy))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"imported at --help: {proc.stdout.strip()}"


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "mlakit.cli", "convert", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "--calib-seq-len" in proc.stdout, proc.stderr


def test_registration_still_happens_when_transformers_is_imported_later():
    """Whoever imports transformers first (the user, or mlakit's own model code), the Auto classes
    are registered, without a warning."""
    script = textwrap.dedent("""
        import sys
        import mlakit
        if sys.argv[1] == "via-mlakit":
            import mlakit.convert.assemble  # mlakit's own code imports transformers first
        from transformers import AutoConfig
        from mlakit.mla_model import MLAConfig
        print(AutoConfig.for_model(MLAConfig.model_type).__class__.__name__)
    """)
    for first in ("via-transformers", "via-mlakit"):
        proc = subprocess.run(
            [sys.executable, "-c", script, first],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "MLAConfig", proc.stderr[-2000:]
        assert "could not register" not in proc.stderr, proc.stderr[-2000:]
