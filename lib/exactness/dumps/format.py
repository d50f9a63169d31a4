"""The dump format's constants: its name and version, the dtype names, the manifest's fields, and DumpError.

A dump set is a folder: ``manifest.json`` (the index: engine, weights, one record per kernel call) and safetensors
files holding the tensors it references. docs/dumps.md is the specification for writers in any language; this
module is its single source of names for the Python writer and reader.
"""
from __future__ import annotations

import torch

FORMAT = "exactness-dumps"
VERSION = 1
MANIFEST = "manifest.json"
BYTE_ORDER = "little"   # safetensors stores every tensor little-endian; the manifest says so explicitly

# dtype name -> (safetensors header dtype, torch dtype). Float8 tensors may carry a scale (an fp32 tensor).
DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "bf16": ("BF16", torch.bfloat16), "fp16": ("F16", torch.float16), "fp32": ("F32", torch.float32),
    "fp64": ("F64", torch.float64), "fp8_e4m3": ("F8_E4M3", torch.float8_e4m3fn),
    "fp8_e5m2": ("F8_E5M2", torch.float8_e5m2), "i8": ("I8", torch.int8), "u8": ("U8", torch.uint8),
    "i16": ("I16", torch.int16), "i32": ("I32", torch.int32), "i64": ("I64", torch.int64), "bool": ("BOOL", torch.bool),
}
FP8 = ("fp8_e4m3", "fp8_e5m2")
ROLES = ("prompt", "decode")
ROW_FIELDS = ("row", "seq", "pos", "token")   # one dumped row: index in the call, sequence, position, token id
PARTS = ("inputs", "fixed", "outputs")        # a call's tensor groups; weights are referenced by name


class DumpError(ValueError):
    """A dump set that cannot be read faithfully; the message is one line naming the call, tensor or field."""


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of torch ``dtype`` (``torch.bfloat16`` -> ``"bf16"``).

    Raises:
        DumpError: a dtype the format has no name for (lists the allowed names).
    """
    for name, (_, dt) in DTYPES.items():
        if dt == dtype:
            return name
    raise DumpError(f"dtype {dtype} has no name in the dump format; allowed: {', '.join(DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of format dtype ``name``. Raises DumpError for an unknown name (lists the allowed ones)."""
    if name not in DTYPES:
        raise DumpError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name][1]


def comparable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dtype exact.py compares element-wise: float8 viewed as uint8 (same bytes), others unchanged."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
