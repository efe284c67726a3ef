"""Downstream accuracy through lm-evaluation-harness (``lm-eval``, the ``eval`` extra): the
zero-shot tasks that conversion papers (TransMLA, MHA2MLA, X-EcoMLA, CARE) report, run with the
harness's own HF wrapper on a loaded model, so our numbers sit next to theirs.

Every model of one eval is scored with the same :class:`TaskSettings` (tasks, shots, limit,
batch size; the harness's fixed seeds). The tasks are resolved and their data loaded before
any model is: an unknown task, a missing extra, or data that cannot be reached (the harness's
tasks read the Hugging Face hub; offline they need a cache, or a local task file) fail first.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import asdict, dataclass

__all__ = [
    "PreparedTasks",
    "TaskEvalError",
    "TaskSettings",
    "prepare_tasks",
    "score_tasks",
    "task_rows",
    "task_settings_dict",
]

logger = logging.getLogger(__name__)

LOCAL_TASK_HINT = (
    "write a local task file (the harness's YAML task format with dataset_path: json and "
    "dataset_kwargs.data_files pointing at a local JSONL) and pass its folder with --include-path DIR"
)


class TaskEvalError(ValueError):
    """A task that cannot be evaluated; the message names it and the fix."""


@dataclass
class TaskSettings:
    tasks: list[str]
    include_path: str | None = None  # a folder of the harness's YAML task files
    num_fewshot: int | None = None  # None: each task's own default (0 for the common zero-shot tasks)
    limit: int | None = None  # documents per task; None: all
    batch_size: int = 4


@dataclass
class PreparedTasks:
    settings: TaskSettings
    task_manager: object  # lm_eval.tasks.TaskManager
    version: str


def _import_harness():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise TaskEvalError(
            f"--tasks needs lm-evaluation-harness, which is not installed ({exc}). "
            "Fix: pip install 'mlakit[eval]' (or pip install 'lm-eval>=0.4.5,<0.5')."
        ) from exc
    return lm_eval, TaskManager


# (include_path, with defaults) -> TaskManager: it indexes every task YAML file lm-eval ships, which is
# slow, so once per process
_MANAGERS: dict = {}


def _task_manager(TaskManager, include_path: str | None, defaults: bool):
    key = (include_path, defaults)
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=include_path, include_defaults=defaults)
    return _MANAGERS[key]


def prepare_tasks(s: TaskSettings) -> PreparedTasks:
    """Resolve S.tasks and load each one's data (no model yet); raises :class:`TaskEvalError`."""
    from pathlib import Path

    if not s.tasks:
        raise TaskEvalError(
            "--tasks is empty. Fix: pass task names separated by commas, e.g. --tasks arc_easy,piqa"
        )
    if s.include_path is not None and not Path(s.include_path).is_dir():
        raise TaskEvalError(
            f"--include-path {s.include_path!r} is not a folder. Fix: pass the folder of your task YAML files."
        )
    lm_eval, TaskManager = _import_harness()
    include = str(Path(s.include_path).resolve()) if s.include_path else None
    manager = _task_manager(TaskManager, include, False) if include else None
    if manager is None or not set(s.tasks) <= set(manager.all_tasks):  # the harness's own tasks are needed
        manager = _task_manager(TaskManager, include, True)
    unknown = [t for t in s.tasks if t not in manager.all_tasks]
    if unknown:
        hints = "; ".join(
            f"{t!r} (close: {', '.join(difflib.get_close_matches(t, manager.all_tasks, n=3)) or 'none'})"
            for t in unknown
        )
        raise TaskEvalError(
            f"unknown task {hints}. Fix: use a name from `lm-eval ls tasks`"
            + (
                f" or from the YAML files in {include}"
                if include
                else ", or pass your own with --include-path DIR"
            )
            + "."
        )
    for name in s.tasks:  # one at a time, so a failure names its task
        try:
            manager.load([name])
        except (ConnectionError, FileNotFoundError, OSError) as exc:
            raise TaskEvalError(
                f"task {name!r}: its data could not be reached ({type(exc).__name__}: {exc}). The harness's "
                "tasks download their datasets from the Hugging Face hub; offline (HF_DATASETS_OFFLINE=1, "
                "or no network) a dataset must already be in the datasets cache. Fix: run once with network "
                f"access to cache it, or {LOCAL_TASK_HINT}."
            ) from exc
        except Exception as exc:  # the harness raises many types for a malformed task file
            raise TaskEvalError(
                f"task {name!r} could not be loaded ({type(exc).__name__}: {exc}). Fix: check its YAML file."
            ) from exc
    return PreparedTasks(s, manager, lm_eval.__version__)


def _counting_lm(model, tokenizer, batch_size: int):
    """The harness's HFLM around a loaded MODEL, counting the requests the harness sends it."""
    from lm_eval.models.huggingface import HFLM

    class CountingHFLM(HFLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.requests = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0}

        def loglikelihood(self, requests, *args, **kwargs):
            self.requests["loglikelihood"] += len(requests)
            return super().loglikelihood(requests, *args, **kwargs)

        def loglikelihood_rolling(self, requests, *args, **kwargs):
            self.requests["loglikelihood_rolling"] += len(requests)
            return super().loglikelihood_rolling(requests, *args, **kwargs)

        def generate_until(self, requests, *args, **kwargs):
            self.requests["generate_until"] += len(requests)
            return super().generate_until(requests, *args, **kwargs)

    return CountingHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")


def _task_entry(results: dict, n_samples: dict, n_shot: dict, versions: dict, name: str) -> dict:
    """The harness's 'metric,filter' keys as {metrics, stderr} for task NAME."""
    metrics, stderr = {}, {}
    for key, value in results.get(name, {}).items():
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, _filter = key.split(",", 1)
        if metric.endswith("_stderr"):
            stderr[metric.removesuffix("_stderr")] = value if isinstance(value, float) else None
        else:
            metrics[metric] = value
    samples = n_samples.get(name, {})
    return {
        "metrics": metrics,
        "stderr": stderr,
        "n_samples": samples.get("effective", samples) if isinstance(samples, dict) else samples,
        "n_shot": n_shot.get(name),
        "version": versions.get(name),
    }


def score_tasks(model, tokenizer, prepared: PreparedTasks, label: str) -> dict:
    """Score one loaded MODEL on the prepared tasks: {task: {metrics, stderr, n_samples, ...}},
    plus ``_requests`` (what the harness asked the model: per-request-type counts)."""
    import lm_eval

    s = prepared.settings
    lm = _counting_lm(model, tokenizer, s.batch_size)
    logger.info("lm-eval %s: %s on %s", prepared.version, label, ", ".join(s.tasks))
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(s.tasks),
        num_fewshot=s.num_fewshot,
        limit=s.limit,
        batch_size=s.batch_size,
        task_manager=prepared.task_manager,
        log_samples=False,
    )
    results = out["results"]
    entries = {
        name: _task_entry(
            results, out.get("n-samples", {}), out.get("n-shot", {}), out.get("versions", {}), name
        )
        for name in results
    }
    return {"tasks": entries, "requests": dict(lm.requests)}


def task_settings_dict(prepared: PreparedTasks) -> dict:
    return {"harness": "lm-eval", "harness_version": prepared.version, **asdict(prepared.settings)}


ACCURACY_METRICS = ("acc", "acc_norm", "exact_match")  # the headline metric of a task, first found


def task_rows(models: list[dict]) -> list[dict]:
    """One row per task: its headline metric and each model's (value, stderr), from the model
    entries' ``tasks`` (the first model's tasks set the rows)."""
    rows = []
    first = models[0].get("tasks") or {}
    for task, entry in first.items():
        metric = next((m for m in ACCURACY_METRICS if m in entry["metrics"]), None) or next(
            iter(entry["metrics"]), None
        )
        if metric is None:
            continue
        values = {}
        for m in models:
            e = (m.get("tasks") or {}).get(task, {})
            values[m["label"]] = (e.get("metrics", {}).get(metric), e.get("stderr", {}).get(metric))
        rows.append({"task": task, "metric": metric, "n_samples": entry.get("n_samples"), "values": values})
    return rows
