"""What ``engines.probe(spec)`` checks before a run, per engine kind, reading no weights and running no model:

    llamacpp       the GGUF header, metadata and tensor index (read_gguf_index): version, an architecture, every
                   tensor's type, shape and data range inside the file
    transformers   config.json (a JSON object with a model_type) and the weights: model.safetensors, or
                   model.safetensors.index.json with every shard present, or pytorch_model*.bin; each safetensors
                   header readable (check_model_folder); the same for a ``draft`` folder
    reference      a checkpoint's config.json and safetensors tensor index against the shapes our model needs
    openai         each configuration given by base_url (launched ones are probed by the adapter once started):
                   GET /v1/models answers a JSON model list, and one greedy token comes back (openai.probe_urls)

Each failure is a ValueError (or EngineError) with one line; ``engines.probe`` puts the spec in front of it.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

PROBE_TIMEOUT_S = 5.0   # per HTTP request: a dead or hanging server is refused within the 15 s a refusal may take
GGUF_VERSIONS = (2, 3)  # the versions llama.cpp and the gguf package read
GGUF_MAX_DIMS = 4


def probe_target(kind: str, target: str, options: dict, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """The check of ``kind`` (module docstring) on ``target`` and ``options`` (as parse_spec returns them).

    Raises:
        ValueError / EngineError: one line saying what failed.
    """
    if kind == "llamacpp":
        read_gguf_index(Path(target))
    elif kind == "transformers":
        check_model_folder(Path(target))
        if isinstance(options.get("draft"), str) and (Path(options["draft"]) / "config.json").is_file():
            check_model_folder(Path(options["draft"]))
    elif kind == "reference" and target:
        check_checkpoint(target)
    elif kind == "openai":
        probe_openai(target, options, timeout_s)


# ------------------------------------------------------------------------------------------------------------ GGUF

class _Bytes:
    """A bounds-checked little-endian reader over a file's bytes (memory-mapped: only the pages read are loaded)."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes of ``what``; returns where they start. Raises ValueError past the end of the file."""
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{what} at byte {self.pos} ({n} bytes) runs past the end of the file "
                             f"({len(self.buf)} bytes): not a complete GGUF file")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from("<" + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, decode: bool = True) -> str | None:
        n = self.unpack("Q", f"the length of {what}")
        start = self.take(n, what)
        if not decode:
            return None
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what} at byte {start} is not UTF-8: not a GGUF file") from None


def _formats() -> tuple[dict, int, int]:
    """({scalar value type: struct format}, STRING, ARRAY) of GGUF's value types (gguf.constants)."""
    from gguf.constants import GGUFValueType as T
    return ({int(T.UINT8): "B", int(T.INT8): "b", int(T.UINT16): "H", int(T.INT16): "h", int(T.UINT32): "I",
             int(T.INT32): "i", int(T.FLOAT32): "f", int(T.BOOL): "?", int(T.UINT64): "Q", int(T.INT64): "q",
             int(T.FLOAT64): "d"}, int(T.STRING), int(T.ARRAY))


def _skip_strings(r: _Bytes, n: int, what: str) -> None:
    """Skip ``n`` length-prefixed strings (a vocabulary: one tight loop, nothing decoded)."""
    buf, pos, end, length = r.buf, r.pos, len(r.buf), struct.Struct("<Q").unpack_from
    for _ in range(n):
        if pos + 8 > end:
            raise ValueError(f"{what} runs past the end of the file ({end} bytes): not a complete GGUF file")
        pos += 8 + length(buf, pos)[0]
    if pos > end:
        raise ValueError(f"{what} runs past the end of the file ({end} bytes): not a complete GGUF file")
    r.pos = pos


def _value(r: _Bytes, vtype: int, what: str, depth: int = 0):
    """Read one metadata value of type ``vtype``; arrays are skipped (None), strings in them not decoded."""
    scalars, string, array = _formats()
    if (vtype not in scalars and vtype not in (string, array)) or depth > 2:
        raise ValueError(f"{what} has value type {vtype}, which GGUF does not define: not a GGUF file")
    if vtype == string:
        return r.string(what, decode=depth == 0)
    if vtype != array:
        return r.unpack(scalars[vtype], what)
    itype, n = r.unpack("I", f"the item type of {what}"), r.unpack("Q", f"the length of {what}")
    if itype in scalars:
        r.take(n * struct.calcsize(scalars[itype]), what)
    elif itype == string:
        _skip_strings(r, n, what)
    elif n * 8 > len(r.buf) - r.pos:   # each item of a nested array takes at least 8 bytes
        raise ValueError(f"{what} claims {n} items, more than the file holds: not a complete GGUF file")
    else:
        for _ in range(n):
            _value(r, itype, what, depth + 1)
    return None


def _gguf_metadata(r: _Bytes, path: Path, size: int) -> tuple[int, dict]:
    """(tensor count, metadata key -> value; arrays None) of the header at the start of ``r``."""
    from gguf.constants import GGUF_MAGIC
    if r.unpack("I", "the magic") != GGUF_MAGIC:
        raise ValueError(f"{path} does not start with the GGUF magic")
    version = r.unpack("I", "the version")
    if version not in GGUF_VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not one llama.cpp reads "
                         f"({', '.join(map(str, GGUF_VERSIONS))}): junk after the magic, or another byte order")
    n_tensors, n_kv = r.unpack("Q", "the tensor count"), r.unpack("Q", "the metadata count")
    if n_tensors == 0 or (n_tensors + n_kv) * 12 > size:
        raise ValueError(f"{path}: the header claims {n_tensors} tensors and {n_kv} metadata entries in a "
                         f"file of {size} bytes: not a GGUF model")
    meta = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        meta[key] = _value(r, r.unpack("I", f"the type of {key!r}"), f"metadata {key!r}")
    if not isinstance(meta.get("general.architecture"), str):
        raise ValueError(f"{path}: the metadata has no general.architecture string; llama.cpp needs one")
    return n_tensors, meta


def _tensor_info(r: _Bytes, path: Path, i: int, align: int) -> tuple[str, int, int]:
    """(name, offset from the data start, bytes) of the i-th tensor-info entry at ``r``'s position."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    name = r.string(f"the name of tensor {i}")
    n_dims = r.unpack("I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= GGUF_MAX_DIMS:
        raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions; allowed 1..{GGUF_MAX_DIMS}")
    dims = [r.unpack("Q", f"the shape of {name!r}") for _ in range(n_dims)]
    gtype, offset = r.unpack("I", f"the type of {name!r}"), r.unpack("Q", f"the offset of {name!r}")
    if gtype not in set(GGMLQuantizationType) or GGMLQuantizationType(gtype) not in GGML_QUANT_SIZES:
        raise ValueError(f"{path}: tensor {name!r} has type {gtype}, which ggml does not define")
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
    if dims[0] % block or offset % align:
        raise ValueError(f"{path}: tensor {name!r} (shape {dims}, offset {offset}) is not aligned to its "
                         f"type's block of {block} or to {align} bytes")
    count = 1
    for d in dims:
        count *= d
    return name, offset, count // block * nbytes


def read_gguf_index(path: Path) -> list[tuple[str, int, int]]:
    """The tensor index of GGUF file ``path``, checked: [(name, first byte, byte count)] of every tensor's data.
    Reads the header, metadata and tensor infos only (a real vocabulary's string arrays are skipped, not decoded).

    Raises:
        ValueError: one line naming what is wrong (magic, version, a field or tensor past the end of the file, an
            unknown value or tensor type, no general.architecture, no tensors).
    """
    from gguf.constants import GGUF_DEFAULT_ALIGNMENT
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path} has {size} bytes, fewer than a GGUF header's 24")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Bytes(buf)
        n_tensors, meta = _gguf_metadata(r, path, size)
        align = meta.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT
        if not isinstance(align, int) or align & (align - 1):
            raise ValueError(f"{path}: general.alignment {align!r} is not a power of two")
        infos = [_tensor_info(r, path, i, align) for i in range(n_tensors)]
        start = -(-r.pos // align) * align
    out = [(name, start + offset, n) for name, offset, n in infos]
    if len({name for name, _, _ in out}) != len(out):
        raise ValueError(f"{path}: a tensor name appears twice in the tensor index")
    for name, first, n in out:
        if first + n > size:
            raise ValueError(f"{path}: tensor {name!r} (bytes {first}..{first + n}) runs past the end of the file "
                             f"({size} bytes): truncated")
    return out


# --------------------------------------------------------------------------------------------------- model folders

def _safetensors_header(path: Path) -> None:
    """Open ``path``'s safetensors header (its JSON and tensor ranges are checked by safetensors, no data read)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="numpy") as st:
            st.keys()
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path.name}: not a readable safetensors file ({e})") from None


def _json_object(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, found {type(d).__name__}")
    return d


def check_model_folder(folder: Path) -> None:
    """A transformers model folder: config.json a JSON object with a model_type, and weights (module docstring).

    Raises:
        ValueError: one line naming the folder or file and what is missing or unreadable.
    """
    cfg = _json_object(folder / "config.json", "config.json")
    if not isinstance(cfg.get("model_type"), str) or not cfg["model_type"]:
        raise ValueError(f"{folder / 'config.json'} has no model_type, so transformers cannot pick a model class")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json_object(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map of tensor name -> shard file")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) {', '.join(missing[:3])}, not in {folder}")
        for s in shards:
            _safetensors_header(folder / s)
    elif (folder / "model.safetensors").is_file():
        _safetensors_header(folder / "model.safetensors")
    elif not any(p.stat().st_size > 0 for p in folder.glob("pytorch_model*.bin")):
        raise ValueError(f"{folder} has config.json but no weights: model.safetensors, model.safetensors.index.json "
                         f"with its shards, or pytorch_model*.bin")


def check_checkpoint(folder: str) -> None:
    """Our engine's checkpoint: config.json as the loader reads it and every tensor it needs, by name, shape and
    dtype from the safetensors headers (checkpoint.py; no tensor data is read).

    Raises:
        ValueError: the loader's one-line CheckpointError.
    """
    from ..checkpoint import CheckpointError, _check_tensors, _tensor_index, expected_shapes, read_config
    try:
        cfg, tied = read_config(folder)
        index = _tensor_index(folder)
        fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" in index for i in range(cfg.n_layers)]
        _check_tensors(index, expected_shapes(cfg, fused, tied), tied)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    except Exception as e:  # noqa: BLE001 -- a broken safetensors header raises the library's own error types
        raise ValueError(f"{folder}: the weights cannot be indexed ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------------------- servers

def probe_openai(target: str, options: dict, timeout_s: float) -> None:
    """Each configuration given by a base_url (or the target URL): openai.probe_urls (GET /v1/models, one greedy
    token), every request allowed at most ``timeout_s`` (or the engine file's timeout_s where shorter).

    Raises:
        ValueError: bad options (as OpenAIEngine.from_spec); EngineError: the server's failure, one line.
    """
    from .openai import probe_urls
    own = options.get("timeout_s")
    if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
        timeout_s = min(float(own), timeout_s)
    probe_urls(target, {**options, "timeout_s": timeout_s})
