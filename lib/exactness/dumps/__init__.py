"""Tensor dumps: a documented, versioned folder format (docs/dumps.md) in which any engine records its kernel calls
(class, role, rows, input/output bytes). The contract and FP64 read a dump set as a source of kernel calls
(analysis/calls.py, analysis/contract/calls.py, analysis/fp64/calls.py).

    format.py    names: format, version, dtypes, DumpError
    writer.py    DumpWriter (Python writer helper)
    reader.py    read_dump: validation, streamed per-call reading
    ours.py      dumps of this suite's engine (model.tapping)
    hf_hooks.py  dumps of a transformers Qwen3-MoE (forward hooks, RoPE wrapper, residual-add dispatch mode)
    llamacpp.py  dumps of llama.cpp (ggml's eval callback); ggml.py reads its graph nodes
"""
