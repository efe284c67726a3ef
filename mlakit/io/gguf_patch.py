"""A scoped patch of gguf and transformers that makes opening one GGUF file parse it once.

Why it exists: transformers reads a GGUF file separately for the config, the weights and the
tokenizer, each time parsing the whole file (a vocabulary of tens of thousands of strings), and
rebuilds gguf's tensor-name map for every submodule of the model. gguf's reader also slices its
``numpy.memmap`` once per metadata value, and a memmap slice costs far more Python than a slice of
an in-memory array. Opening the built-in default model spent most of its time there
(docs/results.md, conversion cost: the ``open`` phase before and after this patch).

Inside ``parse_gguf_once`` a path gives the same parsed, read-only reader each time, parsed from
the file's bytes in memory; its metadata is turned into Python values once (each caller gets a
copy, so none sees another's edits); the name map is built once per architecture. Every patched
attribute is restored on the way out. If a transformers or gguf release reads GGUF files
differently, nothing is shared and nothing breaks: the patch only wraps the functions it finds.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types

__all__ = ["file_in_memory", "parse_gguf_once"]


def file_in_memory(path, mode="r", *args, **kwargs):
    """``numpy.memmap`` for gguf's reader: a read-only file is read into memory instead of mapped
    (every tensor is dequantized anyway, so the map saves no memory)."""
    import numpy as np

    if mode != "r" or args or kwargs:
        return np.memmap(path, mode, *args, **kwargs)
    data = np.fromfile(path, dtype=np.uint8)
    data.flags.writeable = False  # as a read-only map
    return data


@contextlib.contextmanager
def parse_gguf_once():
    """Inside this block, reading one GGUF file with transformers parses it once, from memory
    (see the module docstring)."""
    import gguf
    import gguf.gguf_reader as reader_module
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader_class, name_map, numpy_module = gguf.GGUFReader, gguf.get_tensor_name_map, reader_module.np
    load_checkpoint = hf_gguf.load_gguf_checkpoint
    numpy_in_memory = types.SimpleNamespace(**vars(numpy_module))
    numpy_in_memory.memmap = file_in_memory
    readers = {}

    def shared_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            reader_module.np = numpy_in_memory
            try:
                readers[key] = reader_class(path, *args, **kwargs)
            finally:
                reader_module.np = numpy_module
        return readers[key]

    metadata = {}

    def shared_metadata(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load_checkpoint(path, return_tensors, **kwargs)
        if str(path) not in metadata:
            metadata[str(path)] = load_checkpoint(path, False)
        return copy.deepcopy(metadata[str(path)])

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
    hf_gguf.load_gguf_checkpoint = shared_metadata
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        hf_gguf.load_gguf_checkpoint = load_checkpoint
