"""Opening a GGUF file: inside ``gguf_patch.parse_gguf_once`` a file is parsed once, from memory, and its
metadata is turned into Python values once; outside it nothing is changed."""

from __future__ import annotations

import gguf
import gguf.gguf_reader as reader_module
import numpy as np
from transformers import modeling_gguf_pytorch_utils as hf_gguf

from mlakit.io.gguf_patch import parse_gguf_once


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_uint32("llama.block_count", 2)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(96, dtype=np.float32).reshape(8, 12))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_parsed_once_inside_the_block(monkeypatch, tmp_path):
    made = []

    class CountingReader:
        def __init__(self, path, mode="r"):
            made.append((str(path), mode))

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    maps = []
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, n: maps.append((arch, n)) or object())
    with parse_gguf_once():
        first, second = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "a.gguf")
        other = gguf.GGUFReader(tmp_path / "b.gguf")
        assert first is second and other is not first
        assert gguf.get_tensor_name_map(1, 30) is gguf.get_tensor_name_map(1, 30)
    assert made == [(str(tmp_path / "a.gguf"), "r"), (str(tmp_path / "b.gguf"), "r")]
    assert maps == [(1, 30)]
    assert gguf.GGUFReader is CountingReader  # restored on the way out
    gguf.GGUFReader(tmp_path / "a.gguf")
    assert len(made) == 3


def test_the_reader_inside_the_block_reads_from_memory_and_parses_the_same(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    mapped = gguf.GGUFReader(path)
    with parse_gguf_once():
        in_memory = gguf.GGUFReader(path)
    assert isinstance(mapped.data, np.memmap)
    assert not isinstance(in_memory.data, np.memmap) and not in_memory.data.flags.writeable
    assert reader_module.np is np  # numpy is back for gguf's reader
    assert list(in_memory.fields) == list(mapped.fields)
    for name, field in mapped.fields.items():
        other = in_memory.fields[name]
        assert field.types == other.types and field.data == other.data
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts))
    tokens = in_memory.fields["tokenizer.ggml.tokens"]
    assert bytes(tokens.parts[tokens.data[-1]]) == b"tok299"
    (tensor,) = in_memory.tensors
    assert np.array_equal(np.asarray(tensor.data).reshape(8, 12), np.arange(96, dtype=np.float32).reshape(8, 12))


def test_metadata_is_parsed_once_and_each_caller_gets_its_own_copy(monkeypatch):
    calls = []

    def fake_load(path, return_tensors=False, **kwargs):
        calls.append((path, return_tensors, tuple(kwargs)))
        return {"config": {"vocab": ["a", "b"]}}

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", fake_load)
    with parse_gguf_once():
        first = hf_gguf.load_gguf_checkpoint("m.gguf", return_tensors=False)
        first["config"]["vocab"].append("changed by a caller")
        second = hf_gguf.load_gguf_checkpoint("m.gguf", return_tensors=False)
        hf_gguf.load_gguf_checkpoint("m.gguf", return_tensors=True, model_to_load=None)
        hf_gguf.load_gguf_checkpoint("m.gguf", return_tensors=True, model_to_load=None)
    assert second == {"config": {"vocab": ["a", "b"]}}
    assert calls == [("m.gguf", False, ()), ("m.gguf", True, ("model_to_load",)), ("m.gguf", True, ("model_to_load",))]
    assert hf_gguf.load_gguf_checkpoint is fake_load  # restored on the way out
