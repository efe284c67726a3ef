"""Streaming (layer-wise) conversion: same checkpoint as the in-memory pipeline, resume, CLI, errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from mlakit import load_converted
from mlakit.cli import cli
from mlakit.io import work_dir
from mlakit.io.shard_stream import ShardLayout, read_header
from mlakit.io.work_dir import work_dir_for
from mlakit.pipeline import api as pipeline
from mlakit.pipeline.api import ConversionError, ConvertOptions, StreamOptions, convert, convert_streaming
from mlakit.pipeline.run import choose_pipeline
from tests.convert_helpers import (
    Interrupt,
    assert_same_bytes,
    assert_same_checkpoint,
    checkpoint_tensors,
    layer_records,
    stop_at,
)
from tests.tiny_models import FAMILY_BUILDERS, assert_close

pytestmark = pytest.mark.filterwarnings("ignore")

CALIB = dict(calib="random", calib_samples=12, calib_seq_len=24, dtype="float32", quiet=True)
SETTINGS = {
    "full": {},
    "compressed": dict(kv_lora_rank=20, rope_dim=8),
    "planned": dict(kv_budget=0.4, allocation="planned"),
    "fisher": dict(kv_budget=0.4, allocation="fisher"),
}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def deep_source(tmp_path_factory):
    """A 5-layer tiny Llama (GQA, biases on) saved as safetensors: enough layers to interrupt mid-way."""
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("deep") / "src"
    model.save_pretrained(str(path))
    return path


def _logits(path, ids):
    with torch.no_grad():
        return load_converted(path)(ids).logits


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_in_memory_and_streaming_write_identical_bytes(tiny_sources, tmp_path, family, setting):
    """One driver, two storage policies: the same ranks, the same weights (bit for bit), the same
    layer-wise verification."""
    opts = ConvertOptions(**SETTINGS[setting], **CALIB)
    mem = convert(str(tiny_sources[family]), tmp_path / "mem", opts)
    got = convert_streaming(str(tiny_sources[family]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert layer_records(got) == layer_records(mem) and got["plan"] == mem["plan"] and got["verify"] == mem["verify"]
    assert (got["pipeline"]["name"], mem["pipeline"]["name"]) == ("streaming", "in-memory")
    names = {p.name for p in (tmp_path / "stream").iterdir()}
    assert names == {p.name for p in (tmp_path / "mem").iterdir()}
    assert not list(tmp_path.glob(".stream.partial-*")) and not list(tmp_path.glob(".mem.partial-*"))


def test_only_a_resumable_work_directory_is_synced_as_it_goes(tiny_sources, tmp_path, monkeypatch):
    """The streaming work directory syncs its hidden states and state before each commit (a resume reads
    them after a crash); the in-memory run's scratch directory, which nothing resumes from, syncs only
    the finished shards it publishes."""
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    opts = ConvertOptions(**SETTINGS["fisher"], **CALIB, refine="values")
    convert(str(tiny_sources["llama_gqa"]), tmp_path / "mem", opts)
    assert synced and all(name.endswith(".safetensors") for name in synced), synced
    synced.clear()
    convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "stream", opts)
    assert any(name.startswith("hidden-") for name in synced) and "state.json.tmp" in synced, synced


def test_default_allocation_is_the_same_for_every_source(tiny_sources, tmp_path):
    """--allocation auto resolves to one allocation whichever pipeline runs."""
    opts = ConvertOptions(kv_budget=0.4, **CALIB)
    mem = convert(str(tiny_sources["llama_gqa"]), tmp_path / "mem", opts)
    got = convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "stream", opts)
    assert mem["plan"]["allocation"] == got["plan"]["allocation"] == pipeline.resolve_allocation(opts).allocation
    assert mem["plan"]["allocation"] != "auto"
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")


def test_multi_shard_output_loads_and_equals_single_shard(deep_source, tmp_path, ids):
    opts = ConvertOptions(**SETTINGS["compressed"], **CALIB)
    convert_streaming(str(deep_source), tmp_path / "one", opts)
    convert_streaming(str(deep_source), tmp_path / "many", opts, StreamOptions(max_shard_bytes=40_000))
    shards = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # every shard within the limit unless it holds one bigger tensor
        meta = read_header(tmp_path / "many" / shard)
        assert (
            len(meta) == 1
            or sum(m["data_offsets"][1] - m["data_offsets"][0] for m in meta.values()) <= 40_000
        )
    assert_same_checkpoint(tmp_path / "many", tmp_path / "one")
    assert torch.equal(_logits(tmp_path / "many", ids), _logits(tmp_path / "one", ids))


def test_shard_layout_is_greedy_in_order():
    entries = [(f"t{i}", (10,), torch.float32) for i in range(5)]  # 40 bytes each
    layout = ShardLayout(entries, max_shard_bytes=100)
    assert layout.shards == [[0, 1], [2, 3], [4]]
    assert layout.files[0] == "model-00001-of-00003.safetensors"
    assert ShardLayout(entries, max_shard_bytes=1000).files == ["model.safetensors"]


@pytest.mark.parametrize("store", ["float32", "bfloat16"])
def test_streaming_sensitivities_match_the_whole_model_backward_pass(deep_source, tmp_path, monkeypatch, store):
    """The layer-by-layer backward sweep measures the loss sensitivities the in-memory pipeline's
    single backward pass through the whole model measures (same sequences, same sampled labels): to
    float32 rounding where the work directory keeps float32 hidden states, and close where it keeps
    them in bfloat16 (the default), whose rounding of every layer's input the whole model never sees."""
    from mlakit.arch.families import attention_shape
    from mlakit.convert.calibration import collect_stats
    from mlakit.io.source import open_source
    from mlakit.pipeline.api import calibration_ids
    from mlakit.pipeline.settings import sensitivity_sequences

    monkeypatch.setattr(work_dir, "STORE_DTYPE", getattr(torch, store))
    opts = ConvertOptions(**SETTINGS["fisher"], **CALIB)
    report = convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(batch_size=5))
    seen = report["plan"]
    source = open_source(str(deep_source))
    model = source.load_model(torch.float32)
    ids = calibration_ids(source, opts, model.config.vocab_size)
    want = [st.sensitivity for st in collect_stats(model, ids, attention_shape(source.config), quiet=True,
                                                   sensitivity_samples=sensitivity_sequences(opts, ids.shape[0]),
                                                   seed=opts.seed)]
    assert len(seen["sensitivity"]) == len(want) == 5
    assert seen["sensitivity_sequences"] == sensitivity_sequences(opts, ids.shape[0]) > 0  # what the benches read
    assert_close("sensitivity", torch.tensor(seen["sensitivity"]), torch.tensor(want), atol=0,
                 rtol=1e-5 if store == "float32" else 1e-3)
    assert len(set(want)) == 5 and min(want) > 0


@pytest.mark.parametrize("setting", ["compressed", "fisher"])
def test_each_layers_float64_work_is_done_once(deep_source, tmp_path, monkeypatch, setting):
    """A two-pass plan (fisher) converts from what its statistics pass spilled: the layer metrics
    and the Gram matrix the error curve and the rrr factorisation share are computed once per
    layer, as in a one-pass conversion."""
    from mlakit.convert import compress, low_rank
    from mlakit.pipeline import driver

    calls = {"layer_metrics": 0, "metric_gram": 0}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args):
            calls[name] += 1
            return real(*args)
        monkeypatch.setattr(module, name, wrapper)

    counted(driver, "layer_metrics")
    counted(compress, "metric_gram")
    counted(low_rank, "metric_gram")
    opts = ConvertOptions(**SETTINGS[setting], **CALIB, lowrank_method="rrr")
    convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(batch_size=5))
    assert calls == {"layer_metrics": 5, "metric_gram": 5}


@pytest.mark.parametrize("setting", ["compressed", "planned", "fisher"])
def test_interrupted_conversion_resumes_to_identical_output(deep_source, tmp_path, setting):
    opts = ConvertOptions(**SETTINGS[setting], **CALIB)
    stream = StreamOptions(max_shard_bytes=40_000, batch_size=5)  # shard boundaries inside layers
    convert_streaming(str(deep_source), tmp_path / "reference", opts, stream)

    out = tmp_path / "out"
    # compressed: after layer 3 of 5; planned and fisher: after 3 layers' statistics
    stop = stop_at("convert" if setting == "compressed" else "statistics", 3)
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), out, opts, stream, on_layer=stop)
    work = work_dir_for(out)
    assert not out.exists() and (work / "state.json").is_file()

    with pytest.raises(ConversionError, match="--resume"):
        convert_streaming(str(deep_source), out, opts, stream)
    report = convert_streaming(
        str(deep_source), out, opts, StreamOptions(max_shard_bytes=40_000, batch_size=5, resume=True)
    )
    assert report["pipeline"]["resumed_from_layer"] == (3 if setting == "compressed" else 0)
    assert not work.exists()
    assert_same_checkpoint(out, tmp_path / "reference")
    assert report["verify"] == json.loads((tmp_path / "reference" / "conversion.json").read_text())["verify"]


def test_killed_process_resumes_to_identical_output(deep_source, tmp_path):
    """SIGKILL right after the second layer's commit (no cleanup runs), then --resume."""
    opts = dict(kv_lora_rank=20, rope_dim=8, **CALIB)
    convert_streaming(str(deep_source), tmp_path / "reference", ConvertOptions(**opts))
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        from mlakit.pipeline.api import ConvertOptions, convert_streaming
        def kill_before_the_third(phase, index):
            if (phase, index) == ("convert", 2):
                os.kill(os.getpid(), signal.SIGKILL)
        convert_streaming({str(deep_source)!r}, {str(out)!r}, ConvertOptions(**{opts!r}),
                          on_layer=kill_before_the_third)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = json.loads((work_dir_for(out) / "state.json").read_text())
    assert len(state["layers"]) == 2 and not out.exists()
    report = convert_streaming(str(deep_source), out, ConvertOptions(**opts), StreamOptions(resume=True))
    assert report["pipeline"]["resumed_from_layer"] == 2
    assert_same_checkpoint(out, tmp_path / "reference")


def test_resume_with_changed_settings_is_refused(deep_source, tmp_path):
    opts = ConvertOptions(**SETTINGS["compressed"], **CALIB)
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), tmp_path / "out", opts, on_layer=stop_at("convert", 0))
    assert not work_dir_for(tmp_path / "out").exists()  # nothing finished: nothing kept
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), tmp_path / "out", opts, on_layer=stop_at("convert", 1))
    changed = ConvertOptions(**{**SETTINGS["compressed"], "kv_lora_rank": 16}, **CALIB)
    with pytest.raises(ConversionError, match="settings kv_lora_rank differ"):
        convert_streaming(str(deep_source), tmp_path / "out", changed, StreamOptions(resume=True))


def test_sequential_calibration_changes_later_layers_only(deep_source, tmp_path):
    """Sequential calibration: layer 0 sees the same inputs either way, so it converts the same;
    later layers are fitted to the converted layers' outputs, so they differ."""
    opts = ConvertOptions(**SETTINGS["compressed"], **CALIB)
    convert_streaming(str(deep_source), tmp_path / "default", opts)
    seq = convert_streaming(str(deep_source), tmp_path / "seq", opts, StreamOptions(sequential=True))
    a, b = checkpoint_tensors(tmp_path / "seq"), checkpoint_tensors(tmp_path / "default")
    layer0 = [k for k in a if k.startswith("model.layers.0.self_attn.")]
    later = [k for k in a if k.startswith("model.layers.") and ".self_attn." in k and not k.startswith("model.layers.0.")]
    assert layer0 and all(torch.equal(a[k], b[k]) for k in layer0)
    assert any(not torch.equal(a[k], b[k]) for k in later)
    assert seq["verify"]["max_abs_logit_diff"] > 0


def test_sequential_calibration_at_full_cache_stays_lossless(deep_source, tmp_path, ids):
    # the whole cache with every rotary dim kept: full rank, yet calibrated (the statistics are taken)
    opts = ConvertOptions(kv_budget=1.0, rope_dim=32, allocation="uniform", **CALIB)
    report = convert_streaming(str(deep_source), tmp_path / "seq", opts, StreamOptions(sequential=True))
    assert report["verify"]["max_abs_logit_diff"] < 1e-4
    with torch.no_grad():
        src = LlamaForCausalLM.from_pretrained(str(deep_source)).eval()(ids).logits
    assert_close("sequential full cache vs source", _logits(tmp_path / "seq", ids), src, atol=1e-4)


@pytest.mark.parametrize("setting", ["compressed", "planned"])
def test_interrupted_sequential_conversion_resumes_to_identical_output(deep_source, tmp_path, setting):
    opts = ConvertOptions(**SETTINGS[setting], **CALIB)
    convert_streaming(str(deep_source), tmp_path / "reference", opts, StreamOptions(sequential=True))
    with pytest.raises(Interrupt):
        convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(sequential=True),
                          on_layer=stop_at("convert", 3))
    report = convert_streaming(str(deep_source), tmp_path / "out", opts, StreamOptions(sequential=True, resume=True))
    assert report["pipeline"]["resumed_from_layer"] == 3
    assert_same_checkpoint(tmp_path / "out", tmp_path / "reference")
    assert report["verify"] == json.loads((tmp_path / "reference" / "conversion.json").read_text())["verify"]


def run_cli(*args):
    result = CliRunner().invoke(cli, ["convert", *map(str, args), "-q"])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def test_cli_streams_safetensors_by_default_and_in_memory_on_request(tiny_sources, tmp_path, ids):
    args = [
        "--kv-lora-rank",
        24,
        "--rope-dim",
        8,
        "--calib",
        "random",
        "--calib-samples",
        8,
        "--calib-seq-len",
        16,
        "--dtype",
        "float32",
    ]
    src = tiny_sources["qwen2"]
    code, text = run_cli(src, tmp_path / "auto", *args, "--max-memory", "64GB", "--device", "auto")
    assert code == 0, text
    report = json.loads((tmp_path / "auto" / "conversion.json").read_text())
    assert report["pipeline"]["name"] == "streaming" and report["pipeline"]["calibration_batch"] == 8
    code, text = run_cli(src, tmp_path / "mem", *args, "--pipeline", "in-memory")
    assert code == 0, text
    assert json.loads((tmp_path / "mem" / "conversion.json").read_text())["pipeline"]["name"] == "in-memory"
    assert torch.equal(_logits(tmp_path / "auto", ids), _logits(tmp_path / "mem", ids))


def test_cli_resume_continues_an_interrupted_run(deep_source, tmp_path, monkeypatch):
    args = [
        deep_source,
        tmp_path / "out",
        "--kv-lora-rank",
        20,
        "--rope-dim",
        8,
        "--calib",
        "random",
        "--calib-samples",
        8,
        "--calib-seq-len",
        16,
        "--dtype",
        "float32",
    ]
    real = pipeline.run_conversion  # what the CLI calls; the hook stops it before the third layer
    monkeypatch.setattr(pipeline, "run_conversion", functools.partial(
        real, on_layer=stop_at("convert", 2, KeyboardInterrupt)))
    code, _ = run_cli(*args)
    assert code != 0 and work_dir_for(tmp_path / "out").is_dir()
    monkeypatch.undo()
    code, text = run_cli(*args)
    assert code == 1 and "pass --resume to continue it" in text, text
    code, text = run_cli(*args, "--resume")
    assert code == 0, text
    report = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert report["pipeline"]["resumed_from_layer"] == 2 and len(report["layers"]) == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-memory", "1KB"], "--max-memory 0.00 GiB is below the estimated"),
        (["--max-memory", "lots"], "is not a memory size; write e.g. 4GB"),
        (["--max-memory", "0"], "must be a positive size"),
        (["--device", "tpu"], "--device (device) must be one of cpu, cuda, cuda:N, auto; got 'tpu'"),
        (["--pipeline", "fast"], "'fast' is not one of 'auto', 'streaming', 'in-memory'"),
        (["--pipeline", "in-memory", "--resume"], "--resume needs the streaming pipeline"),
        (["--pipeline", "in-memory", "--max-memory", "8GB"], "--max-memory needs the streaming pipeline"),
    ],
)
def test_cli_errors_name_the_fix(tiny_sources, tmp_path, args, message):
    code, text = run_cli(
        tiny_sources["llama_gqa"], tmp_path / "out", "--kv-lora-rank", 24, "--calib", "random", *args
    )
    assert code != 0 and message in text, text
    assert not (tmp_path / "out").exists() and not work_dir_for(tmp_path / "out").exists()


def test_pickle_checkpoints_load_in_memory(tmp_path):
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    model.config.architectures = ["LlamaForCausalLM"]
    (tmp_path / "src").mkdir()
    model.config.to_json_file(str(tmp_path / "src" / "config.json"))
    torch.save(model.state_dict(), str(tmp_path / "src" / "pytorch_model.bin"))
    assert choose_pipeline(str(tmp_path / "src")) == "in-memory"
    with pytest.raises(ConversionError, match="use --pipeline in-memory"):
        convert_streaming(str(tmp_path / "src"), tmp_path / "out", ConvertOptions(quiet=True))
    code, text = run_cli(tmp_path / "src", tmp_path / "out", "--dtype", "float32")
    assert code == 0, text


def test_max_memory_counts_the_fisher_sweep():
    """The fisher backward sweep holds the LM head in float32: with a Llama-3-8B shape (128K-token
    vocabulary, bf16 checkpoint) that is 3 GiB more than a calibration step, so a --max-memory
    that fits the step but not the sweep is refused up front, with the fix named."""
    from mlakit.arch.families import attention_shape
    from mlakit.convert.calibration import LOGIT_ROWS
    from mlakit.pipeline.stream_memory import (
        choose_batch_size,
        current_rss,
        estimate_step_bytes,
        estimate_sweep_bytes,
    )

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, torch_dtype="bfloat16",
                      architectures=["LlamaForCausalLM"])
    shape = attention_shape(cfg)
    sweep = estimate_sweep_bytes(cfg, shape, 256, 8, LOGIT_ROWS)
    assert sweep["head"] == 128256 * 4096 * 6
    step = estimate_step_bytes(cfg, shape, 256, 8)["step_peak"]
    limit = current_rss() + max(step, sweep["sweep_peak"] - 2**30)  # the step fits, the sweep does not
    assert choose_batch_size(cfg, shape, 256, 8, limit) == 8
    with pytest.raises(ValueError, match="--allocation fisher backward sweep needs") as err:
        choose_batch_size(cfg, shape, 256, 8, limit, sweep=sweep)
    assert "--allocation uniform or planned" in str(err.value)
