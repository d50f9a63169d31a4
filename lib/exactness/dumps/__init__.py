"""Tensor dumps: a documented, versioned folder format (docs/dumps.md) in which any engine records its kernel calls
(class, role, rows, input/output bytes), and the kernel contract checked on it.

    format.py    names: format, version, dtypes, DumpError
    writer.py    DumpWriter (Python writer helper)
    reader.py    read_dump: validation, streamed per-call reading
    contract.py  dump_contract(folder) -> dict; render.py: render_md
    fp64.py      dump_fp64(folder) -> dict: FP64 reference error per class; render_fp64_md
    ours.py      dumps of this suite's engine (model.tapping)
    hf_hooks.py  dumps of a transformers Qwen3-MoE (forward hooks, RoPE wrapper, residual-add dispatch mode)
    llamacpp.py  dumps of llama.cpp (ggml's eval callback); ggml.py reads its graph nodes
"""
from .contract import dump_contract  # noqa: F401
from .fp64 import dump_fp64, render_fp64_md  # noqa: F401
from .format import FORMAT, VERSION, DumpError  # noqa: F401
from .reader import DumpSet, read_dump  # noqa: F401
from .render import render_md  # noqa: F401
from .writer import DumpWriter, Fixed  # noqa: F401
