"""One conversion run: check the options and OUT, open the source, drive the layers, publish.

Every source goes through the one layer-wise driver (``driver.LayerDriver``); the two
``--pipeline`` values are storage policies around it, not two orchestrations:
- ``streaming`` (safetensors directories): tensors read from disk when a layer needs them, the
  work directory ``.OUT.partial-streaming`` beside OUT survives an interruption (``--resume``);
- ``in-memory`` (GGUF files and pickles, which have no lazy reader; any source on request):
  every tensor held in memory once, the work directory a marked scratch directory that a failed
  or killed run leaves to be removed.
Both run the same per-layer code on the same calibration batches, so they write the same bytes.
"""

from __future__ import annotations

import logging
import resource
import shutil
import time
from pathlib import Path

import torch

from ..arch.families import attention_shape
from ..convert.assemble import check_shapes, mla_config
from ..convert.engine_target import fit_target
from ..io.output_dir import OutputExistsError, check_output, claim_output, local_paths
from ..io.shard_stream import read_header
from ..io.source import SourceError, open_source, resolve_source
from ..io.work_dir import WorkDir, open_work_dir, work_dir_for
from ..io.writer import write_json
from .driver import LayerDriver
from .report import conversion_report, write_side_files
from .run_state import ConversionSetup, LayerRecord, StreamOptions
from .settings import ConversionError, resolve_allocation

__all__ = ["PIPELINES", "choose_pipeline", "resolve_device", "run_conversion"]

log = logging.getLogger(__name__)

PIPELINES = ("auto", "streaming", "in-memory")


def choose_pipeline(src: str, pipeline: str = "auto") -> str:
    """'streaming' or 'in-memory' for SRC: auto streams local/hub directories of safetensors shards
    (read lazily) and holds GGUF files and pickles in memory (they have no lazy reader)."""
    if pipeline not in PIPELINES:
        raise ConversionError(f"--pipeline {pipeline!r} is not one of {', '.join(PIPELINES)}")
    if pipeline != "auto":
        return pipeline
    kind, path = resolve_source(src)
    return "streaming" if _is_safetensors_dir(kind, path) else "in-memory"


def _is_safetensors_dir(kind: str, path) -> bool:
    return kind == "dir" and any(Path(path).glob("*.safetensors"))


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else is checked and kept."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ConversionError(f"--device {device!r} is not one of cpu, cuda, cuda:N, auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device} was asked for but no CUDA device is visible; use --device cpu or auto")
    return device


def run_conversion(src: str, out, opts, pipeline: str = "auto", stream: StreamOptions | None = None, recipe=None,
                   precheck=None, on_layer=None) -> dict:
    """Convert SRC into an MLA checkpoint at OUT; returns the conversion report.

    PIPELINE: the storage policy (module docstring). RECIPE (optional) only names the recipe the
    options came from, for the saved copy. PRECHECK (optional) is called with the source config and
    its ``attention_shape`` before any calibration; it raises to refuse the source (the deepseek-v3
    export checks biases and rope there). ON_LAYER: ``LayerDriver``'s hook."""
    stream = stream or StreamOptions()
    try:
        opts = resolve_allocation(fit_target(opts))
    except ValueError as exc:
        raise ConversionError(str(exc)) from exc
    torch.manual_seed(opts.seed)
    start = time.time()
    check_output(out, opts.overwrite, local_paths(src))  # before the source is resolved (a hub id downloads)
    chosen = choose_pipeline(src, pipeline)
    kind, src_path = resolve_source(src)
    if chosen == "in-memory" and (stream.resume or stream.max_memory is not None):
        flag = "--resume" if stream.resume else "--max-memory"
        why = "was asked for" if pipeline == "in-memory" else f"was chosen because {src} is not a directory of safetensors"
        raise ConversionError(
            f"{flag} needs the streaming pipeline, but the in-memory one {why}; "
            f"drop {flag}, or pass a model directory with *.safetensors and --pipeline streaming"
        )
    if chosen == "streaming" and not _is_safetensors_dir(kind, src_path):
        raise ConversionError(
            f"{src} is not a directory of *.safetensors files, so it cannot be read layer by "
            f"layer; use --pipeline in-memory (GGUF and pickle checkpoints load whole)"
        )
    log.info("%s pipeline for %s", chosen, src)
    with claim_output(out, opts.overwrite, sources=[src_path]) as claim:
        return _run(claim, src, opts, stream, chosen, recipe, precheck, on_layer, start)


def _run(claim, src: str, opts, stream: StreamOptions, pipeline: str, recipe, precheck, on_layer, start) -> dict:
    source = open_source(src)
    if precheck is not None:
        precheck(source.config, attention_shape(source.config))
    if pipeline == "in-memory":
        source.hold_in_memory()
    setup = ConversionSetup(source, opts, stream)
    opts = setup.opts
    resumable = pipeline == "streaming"
    if resumable:
        work = WorkDir(work_dir_for(claim.out))
        state = open_work_dir(work, setup.fingerprint(), stream.resume)
    else:
        work, state = WorkDir(claim.scratch(), durable=False), {"layers": []}  # nothing resumes from it
    resumed_from = len(state["layers"])
    if setup.ranks is not None:
        state.setdefault("ranks", setup.ranks)
    phases = {"open": round(time.time() - start, 2)}  # this process's seconds per phase (a resumed run skips some)

    def timed(name, fn):
        tick = time.time()
        result = fn()
        phases[name] = round(time.time() - tick, 2)
        return result

    try:
        driver = LayerDriver(setup, work, state, on_layer)
        if setup.two_pass and "ranks" not in state:
            timed("statistics", driver.statistics_pass)
            if setup.n_sensitivity and "sensitivity" not in state:
                timed("sensitivity_sweep", driver.sensitivity_sweep)
            driver.plan()
        timed("convert", driver.convert_pass)
        verify = timed("verify", driver.verify_report) if opts.verify else None
        report = _finish(work, src, setup, opts, state, recipe, verify, {
            "name": pipeline,
            "calibration_batch": setup.batch_size,
            "resumed_from_layer": resumed_from,
            "layer_seconds": state.get("layer_seconds", []),
            "phase_seconds": phases,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }, start)
    except BaseException as exc:
        # a damaged source (non-finite or unreadable tensor) must be replaced, and a resume from another
        # source is refused: the finished layers are worth nothing
        damaged = isinstance(exc, SourceError)
        if not resumable or damaged or (not state.get("layers") and not state.get("stats_done") and not stream.resume):
            shutil.rmtree(work.path, ignore_errors=True)
        else:
            log.warning("conversion interrupted; %s keeps the finished layers: rerun with --resume to continue",
                        work.path)
        raise
    work.remove_resume_files()
    try:
        claim.publish(work.path)
    except OutputExistsError as exc:
        if not resumable:
            shutil.rmtree(work.path, ignore_errors=True)
            raise
        # the finished checkpoint is kept: it cost a whole conversion
        raise OutputExistsError(f"{exc}. The finished checkpoint is in {work.path}; move it where you want it") from exc
    log.info("wrote %s in %.1f s", claim.out, time.time() - start)
    return report


def _finish(work: WorkDir, src, setup, opts, state, recipe, verify, pipeline: dict, start: float) -> dict:
    """Config, strict shape check, side files and report into the work directory."""
    records = state["layers"]
    layers = [LayerRecord(r["kv_lora_rank"], r["qk_rope_head_dim"], r["rope_freq_index"]) for r in records]
    config = mla_config(setup.source.config, setup.shape, layers, setup.dtype)
    written = {}  # strict transfer, checked on the written shard headers (no weight is read back)
    for f in work.path.glob("*.safetensors"):
        written.update({k: torch.empty(v["shape"], device="meta") for k, v in read_header(f).items()})
    check_shapes(config, written)
    plan = setup.plan_report | ({"ranks": state["ranks"]} if opts.kv_budget is not None else {})
    if state.get("sensitivity") is not None:
        plan |= {"sensitivity": state["sensitivity"], "sensitivity_sequences": setup.n_sensitivity}
    report = conversion_report(src, setup, opts, plan, records, pipeline)
    write_side_files(work.path, setup.source, config, opts, recipe)
    if verify is not None:
        report["verify"] = verify
    report["seconds"] = round(time.time() - start, 2)
    write_json(work.path / "conversion.json", report)
    return report
