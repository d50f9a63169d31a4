"""A source of kernel calls: what the recorded-calls contract (contract/calls.py) and FP64 (fp64/calls.py) read.

A source is a dump set (docs/dumps.md): a folder, read and validated with dumps.reader, or an already read
``DumpSet``. Every engine records its calls as one: our engine through its taps (dumps/ours.py, or
:func:`engine_calls` here), transformers through forward hooks (dumps/hf_hooks.py), llama.cpp through ggml's eval
callback (dumps/llamacpp.py), any other engine through a writer in its own language.
"""
from __future__ import annotations

import os

from ..dumps.ours import dump_engine
from ..dumps.reader import DumpSet, read_dump


def open_calls(source) -> DumpSet:
    """The calls of ``source``: a dump folder (str or path-like; read_dump) or a DumpSet (returned as is).

    Raises:
        DumpError: an invalid dump set (one line). TypeError: a source of another type.
    """
    if isinstance(source, DumpSet):
        return source
    if isinstance(source, (str, os.PathLike)):
        return read_dump(source)
    raise TypeError(f"source {type(source).__name__} is not a source of kernel calls; allowed: a dump folder "
                    f"(str or path) or a DumpSet")


def engine_calls(folder, weights, prompt_ids, kernels="invariant", **run) -> DumpSet:
    """Our engine's kernel calls on one prompt (the ``path`` prompt role against the decode role, recorded through
    its taps into ``folder``: dumps.ours.dump_engine, whose keywords ``run`` takes), as a source.

    Raises:
        ValueError: an unknown kernel set or path, or a prompt longer than max_positions. FileExistsError:
            ``folder`` is not empty.
    """
    return read_dump(dump_engine(folder, weights, prompt_ids, kernels, **run))
