"""The stock export as engines read it: a no-op YaRN for the default rope (exact in transformers 4.x and
5.x), the legacy rope fields 4.x loaders need, and refusals (or transformers-only opt-ins) for what vLLM's
DeepSeek model would rewrite or drop."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mlakit import load_converted
from mlakit.arch import AttentionShape
from mlakit.export import ExportError, ExportOptions, convert_to_format, export
from mlakit.export.deepseek_v3 import noop_yarn
from mlakit.export.engine_rules import check_source_for_export, vllm_problems
from mlakit.options import OptionsError
from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import BLOCK_MLAKIT, assert_close

ROOT = Path(__file__).resolve().parent.parent
TF4_PYTHON = os.environ.get("MLAKIT_TF4_PYTHON") or str(ROOT / ".venv-tf4" / "bin" / "python")
CALIB = dict(calib="random", calib_samples=8, calib_seq_len=32, dtype="float32", quiet=True)
STOCK = dict(rope_method="transmla", rope_dim=16, kv_lora_rank=20)
FP32_BOUND = 1e-3
ULP_BOUND = 3e-7  # relative: a float32 blend of two equal tables may round by one unit

# Rope tables and attention scales of a DeepSeek-V3 config with plain rope and with the no-op YaRN,
# computed by whichever transformers runs the script (argv[1]: JSON of the two rope dicts).
ROPE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, transformers
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    ropes = json.loads(sys.argv[1])
    out = {"version": transformers.__version__}
    for name, rope in ropes.items():
        base = dict(vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=16,
                    q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    max_position_embeddings=256)
        if transformers.__version__.startswith("4."):  # 4.x reads the legacy fields only
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            cfg = DeepseekV3Config(**base, rope_theta=rope["rope_theta"],
                                   rope_scaling=None if rope["rope_type"] == "default" else scaling)
        else:
            cfg = DeepseekV3Config(**base, rope_parameters=rope)
        emb = DeepseekV3RotaryEmbedding(cfg)
        x = torch.zeros(1, 200, 16)
        cos, sin = emb(x, torch.arange(200)[None])
        out[name] = {"inv_freq": emb.inv_freq.tolist(), "attention_scaling": float(emb.attention_scaling),
                     "softmax_scale": float(DeepseekV3Attention(cfg, 0).scaling),
                     "cos": cos.flatten().tolist(), "sin": sin.flatten().tolist()}
    print(json.dumps(out))
""")


def rope_tables(python: str) -> dict:
    ropes = {"default": {"rope_type": "default", "rope_theta": 500.0}, "noop_yarn": noop_yarn(500.0, 256)}
    proc = subprocess.run(
        [python, "-c", ROPE_SCRIPT, json.dumps(ropes)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tf4_python() -> str:
    if not Path(TF4_PYTHON).is_file():
        pytest.skip(f"no transformers 4.x interpreter at {TF4_PYTHON}: run `bash scripts/setup.sh --tests`")
    return TF4_PYTHON


@pytest.mark.parametrize("version", ["5.x", "4.x"])
def test_noop_yarn_is_plain_rope(version):
    """Same inverse frequencies, cos/sin at 200 positions, rope attention factor and softmax scale."""
    import sys

    got = rope_tables(sys.executable if version == "5.x" else tf4_python())
    assert got["version"].startswith(version[0]), got["version"]
    plain, yarn = got["default"], got["noop_yarn"]
    assert_close(f"inv_freq ({version})", torch.tensor(yarn["inv_freq"]), torch.tensor(plain["inv_freq"]),
                 atol=1e-7, rtol=ULP_BOUND)
    # the tables are float32 functions of angles up to 199 rad, where float32's spacing is 1.5e-5; the two
    # rope paths have once differed by 1.5e-4 on cos in a full-suite run (never alone): a real scaling of
    # the frequencies moves them by far more, and the inverse frequencies above are compared to the ulp
    for key in ("cos", "sin"):
        assert_close(f"{key} ({version})", torch.tensor(yarn[key]), torch.tensor(plain[key]), atol=5e-4)
    assert yarn["attention_scaling"] == plain["attention_scaling"] == 1.0
    assert yarn["softmax_scale"] == plain["softmax_scale"] == 32**-0.5


# --- exports of tiny models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def natives(tiny_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for family in ("llama_gqa", "llama3_scaled", "qwen2"):
        out[family] = root / family
        convert(str(tiny_sources[family]), out[family], ConvertOptions(**STOCK, **CALIB))
    return out


@pytest.fixture(scope="module")
def exports(natives, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    opts = {
        "llama_gqa": ExportOptions(),
        "llama3_scaled": ExportOptions(rope_scaling="hf-exact"),
        "qwen2": ExportOptions(biases="hf-exact"),
    }
    return {name: (root / name, export(natives[name], root / name, o)) for name, o in opts.items()}


def test_default_rope_is_written_as_noop_yarn_with_legacy_fields(exports):
    dest, report = exports["llama_gqa"]
    cfg = json.loads((dest / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope == noop_yarn(rope["rope_theta"], cfg["max_position_embeddings"])
    assert cfg["rope_theta"] == rope["rope_theta"]  # transformers 4.x reads these two
    assert cfg["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert report["verify"]["max_abs_logit_diff_fp32"] <= FP32_BOUND


TF4_LOAD = BLOCK_MLAKIT + textwrap.dedent("""
    import json, sys
    import torch, transformers
    from transformers import AutoModelForCausalLM
    assert transformers.__version__.startswith("4."), transformers.__version__
    jobs = json.loads(sys.argv[1])
    with torch.no_grad():
        for name, job in jobs.items():
            model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()
            assert type(model).__module__.startswith("transformers.models.deepseek_v3"), type(model).__module__
            ids = torch.load(job["ids"])
            gen = model.generate(ids[:, :4], max_new_tokens=16, min_new_tokens=16, do_sample=False)
            torch.save({"logits": model(ids).logits, "greedy": gen}, job["out"])
    print("OK")
""")


@torch.no_grad()
def test_exports_load_exactly_under_transformers_4(natives, exports, tmp_path):
    """No mlakit, no remote code: default rope (no-op YaRN), llama3 (hf-exact) and Qwen2 biases (hf-exact)."""
    python = tf4_python()
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    jobs = {
        n: {"dir": str(d), "ids": str(tmp_path / "ids.pt"), "out": str(tmp_path / f"{n}.pt")}
        for n, (d, _) in exports.items()
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [python, "-c", TF4_LOAD, json.dumps(jobs)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
    for name in exports:
        native = load_converted(natives[name], torch.float32)
        got = torch.load(tmp_path / f"{name}.pt")
        err = assert_close(
            f"{name} under transformers 4.x", got["logits"], native(ids).logits, atol=FP32_BOUND
        )
        print(f"{name}: transformers 4.x max |dlogit| {err:.2e}")
        want = native.generate(ids[:, :4], max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert torch.equal(got["greedy"], want), name


def test_engines_report_and_readme_say_what_vllm_misreads(exports):
    shape_only, scaled, biased = (exports[n] for n in ("llama_gqa", "llama3_scaled", "qwen2"))
    problems = shape_only[1]["engines"]["vllm"]["problems"]
    assert len(problems) == 1 and "Head dimension 36 is not supported by MLA" in problems[0]
    assert any(
        "rope_type 'llama3'" in p and "DeepSeek-YaRN" in p for p in scaled[1]["engines"]["vllm"]["problems"]
    )
    assert any("drops them" in p for p in biased[1]["engines"]["vllm"]["problems"])
    for dest, report in (scaled, biased):
        assert report["engines"]["vllm"]["serves_exactly"] is False
        text = (dest / "README.md").read_text()
        assert "NOT for vLLM" in text and "vllm serve OUT" in text
        assert json.loads((dest / "export.json").read_text())["engines"] == report["engines"]


def test_vllm_problems_accept_only_the_engine_shape():
    rope = noop_yarn(1e4, 4096)
    assert vllm_problems(512, 64, rope, keep_biases=False) == []
    assert "only its Triton MLA backend" in vllm_problems(448, 64, rope, keep_biases=False)[0]
    assert (
        "Head dimension 120" in vllm_problems(88, 32, rope, keep_biases=False)[0]
    )  # the SmolLM2 recipe's shape


# --- refusals, each naming the fix ---------------------------------------------------------------


def test_scaled_rope_is_refused_naming_vllm_and_the_alternatives(natives, tmp_path):
    with pytest.raises(ExportError) as err:
        export(natives["llama3_scaled"], tmp_path / "x")
    text = str(err.value)
    for part in (
        "rope_type 'llama3'",
        "vLLM's DeepSeek model rewrites",
        "--rope-scaling hf-exact",
        "vllm serve OUT",
    ):
        assert part in text, (part, text)
    with pytest.raises(
        OptionsError, match=r"--rope-scaling \(rope_scaling\) must be one of 'refuse' or 'hf-exact'"
    ):
        export(natives["llama3_scaled"], tmp_path / "y", ExportOptions(rope_scaling="keep"))
    assert not list(tmp_path.iterdir())


def test_biases_refusal_names_vllm_and_the_plugin(natives, tmp_path):
    with pytest.raises(ExportError, match=r"vLLM's DeepSeek model has no attention biases.*vllm serve OUT"):
        export(natives["qwen2"], tmp_path / "x")


def test_export_target_vllm_refuses_what_vllm_would_refuse_or_misread(natives, tmp_path):
    with pytest.raises(ExportError, match=r"--target vllm, but vLLM would refuse.*Head dimension 36"):
        export(natives["llama_gqa"], tmp_path / "x", ExportOptions(target="vllm"))
    assert not list(tmp_path.iterdir())


def test_transformers_only_options_contradict_target_vllm():
    shape = AttentionShape("Qwen2ForCausalLM", 4, 2, 16, 64, qkv_bias=True, o_bias=False, window=None)
    config = type("Cfg", (), {"rope_parameters": {"rope_type": "default"}, "max_position_embeddings": 4096})()
    check_source_for_export(config, shape, ExportOptions(biases="hf-exact"))  # fine without a target
    # the contradiction is refused when the options are made, before any source is read
    with pytest.raises(OptionsError, match=r"--biases hf-exact and --target vllm contradict .*--biases drop"):
        ExportOptions(biases="hf-exact", target="vllm")
    with pytest.raises(OptionsError, match=r"--rope-scaling hf-exact and --target vllm contradict"):
        ExportOptions(rope_scaling="hf-exact", target="vllm")
    # and the source check still refuses what vLLM would misread, for options built without the model
    duck = SimpleNamespace(target="vllm", biases="hf-exact", rope_scaling="hf-exact", clip_context=False)
    with pytest.raises(ExportError, match=r"--target vllm, but .*attention biases \(--biases hf-exact\)"):
        check_source_for_export(config, shape, duck)
    config.rope_parameters = {"rope_type": "llama3"}
    with pytest.raises(ExportError, match=r"--target vllm, but .*rope_type 'llama3'"):
        check_source_for_export(config, replace(shape, qkv_bias=False), duck)


@pytest.mark.parametrize(
    ("family", "match"),
    [
        ("llama3_scaled", "--rope-scaling hf-exact"),
        ("qwen2", "--biases hf-exact"),
        ("mistral", "--clip-context"),
    ],
)
def test_convert_format_refuses_the_source_before_calibrating(
    tiny_sources, tmp_path, monkeypatch, family, match
):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran before the export's checks")

    monkeypatch.setattr("mlakit.pipeline.run_state.calibration_ids", no_calibration)
    opts = ConvertOptions(kv_budget=0.5, **CALIB)
    with pytest.raises(ExportError, match=match):
        convert_to_format("deepseek-v3", str(tiny_sources[family]), tmp_path / "x", opts)
    assert not list(tmp_path.iterdir())
