"""Dumps of llama.cpp (llama-cpp-python): every computed node of ggml's graph, through the scheduler's eval callback
(``llama_context_params.cb_eval``), written to a dump set (docs/dumps.md) as it is computed.

Roles: the prompt as one ``llama_decode`` of P tokens, split by llama.cpp in micro-batches of ``n_ubatch`` rows,
is the prompt role; the same prompt fed one token per ``llama_decode`` after clearing the KV cache (and
``gen_tokens`` greedy steps after it) is the decode role. Both use one context: the same model file, KV cache
type, threads and (as engines/llamacpp.py) no flash attention.

Each computed node (view, reshape, permute and transpose compute nothing and are no calls) is one call:
    class     ours where one exists, else the ggml op name (an engine class, ``class_map`` value null):
              MUL_MAT on a weight -> ``dense`` (``router`` for ffn_gate_inp, ``lm_head`` for output), on a KV cache
              view -> ``attention``; MUL_MAT_ID -> ``expert_gate_up`` / ``expert_down`` by weight name; RMS_NORM ->
              ``rmsnorm``; ROPE -> ``rope``; SOFT_MAX -> ``attention`` (kq_soft_max) / ``router`` (ffn_moe_probs);
              FLASH_ATTN_EXT -> ``attention``; ADD -> ``residual`` (ffn_inp, l_out) / ``moe_combine`` (ffn_moe_out)
    site      the node's ggml name (``attn_norm-0``, ``ffn_moe_gate-1``), ``#k`` added for its k-th repeat in one
              graph (``Qcur-0`` is the q projection, ``Qcur-0#1`` its RoPE)
    kernel    ``ggml.<OP>`` (``replaces`` the same: one ggml op serves both roles)
    rows      the micro-batch's tokens, row i at position ``pos0 + i`` of sequence 0 (checked against ``inp_pos``
              at each ROPE); a node's token axis is carried from the token inputs through each op (ggml.Axes)
    inputs    ``src<i>``: the node's sources that have a token axis, read before the node runs (ggml computes
              some ops in place); sources that are KV cache views go to ``fixed`` by position (axis 0 the cell,
              cell = position), other non-row sources (weights excepted) to ``fixed`` whole
    weights   ``src<i>`` -> the GGUF tensor name (stored with ``weights=True``; else only named in meta)
    names     mapped nodes use docs/dumps.md's names instead (``NAMES``: MUL_MAT x/w, ADD a/b, ROPE x/positions
              and meta theta, RMS_NORM x and meta eps)
    outputs   ``y``: the node's rows. A node with no token axis but a cell axis (SET_ROWS into the K cache) has
              the cache cells of the rows' positions as rows. Nodes with neither are not dumped (counted in the
              manifest's meta, ``skipped``).
Row tensors are ``[rows, ...]`` with ggml's dims reversed and the token axis taken out; axes of length 1 are
dropped so that a one-token decode row and a prompt row have one shape. On a node with a KV-cell axis (kq and its
softmax) the cells after the row's position are written as zero in both roles: the causal mask discards them and
they hold the batch's later keys in the prompt role, empty cells in the decode role.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch

from . import ggml
from .format import DumpError
from .writer import DumpWriter, Fixed

ENGINE = "llama.cpp"
LAYER = re.compile(r"-(\d+)$")
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}   # ggml type ids of the KV cache
# the names docs/dumps.md recommends (the FP64 evaluation reads them) for the sources of mapped ops
NAMES = {("MUL_MAT", "dense"): {"src0": "w", "src1": "x"}, ("MUL_MAT", "lm_head"): {"src0": "w", "src1": "x"},
         ("ADD", "residual"): {"src0": "a", "src1": "b"}, ("ROPE", "rope"): {"src0": "x", "src1": "positions"},
         ("RMS_NORM", "rmsnorm"): {"src0": "x"}}


def classify(op: str, nm: str, weight: str | None, src0_cache: bool) -> str:
    """Our kernel class of a ggml node (op, name, its src0 weight name, whether src0 is a KV cache view), or the
    ggml op name when none applies."""
    if op == "MUL_MAT":
        if src0_cache:
            return "attention"
        if weight:
            return "router" if "ffn_gate_inp" in weight else "lm_head" if weight.startswith("output.") else "dense"
    if op == "MUL_MAT_ID" and weight:
        return "expert_down" if "down" in weight else "expert_gate_up"
    if op == "SOFT_MAX":
        return "attention" if nm.startswith("kq") else "router" if nm.startswith("ffn_moe_probs") else op
    if op == "ADD":
        return "residual" if nm.startswith(("ffn_inp", "l_out")) else "moe_combine" if nm.startswith(
            "ffn_moe_out") else op
    return {"RMS_NORM": "rmsnorm", "ROPE": "rope", "FLASH_ATTN_EXT": "attention"}.get(op, op)


def _is_weight(t: ggml.GgmlTensor, op: str) -> bool:
    nm = t.name.decode(errors="replace")
    return op == "NONE" and any(k in nm for k in (".weight", ".bias", ".scale"))


class Recorder:
    """The eval callback (``callback``): writes each computed node of the selected rows to ``writer``.

    Args:
        writer: a DumpWriter; layers: layer numbers to dump (None: all; nodes of no layer are always dumped);
        positions: (start, stop) positions to dump (None: all); weights: store the weights the calls use;
        on_output: called as ``on_output(role, site, y, positions)`` after a node is computed and before it is
            read, with ``y`` the node's bytes in place ([ne3, ne2, ne1, ne0], writes reach ggml) and the
            micro-batch's positions (a planted fault).
    """

    def __init__(self, writer: DumpWriter, layers=None, positions=None, weights: bool = False, on_output=None):
        self.dw, self.g = writer, ggml.Ggml()
        self.layers = None if layers is None else {int(x) for x in layers}
        self.span = positions
        self.store_weights, self.on_output = weights, on_output
        self.role, self.next_pos, self.error = None, 0, None
        self.axes, self.rows, self.pending, self.seen = None, [], None, Counter()
        self.skipped: Counter = Counter()

    def start(self, role: str) -> None:
        """The next llama_decode calls belong to ``role``, from position 0 of an empty cache."""
        self.role, self.next_pos = role, 0

    def callback(self, ptr, ask, _user) -> bool:
        if self.error is not None:
            return False
        try:
            return self._ask(ptr) if ask else self._done(ptr)
        except Exception as e:   # an exception cannot cross the C callback: kept, raised after llama_decode
            self.error = e
            return False

    # ------------------------------------------------------------------ graph
    def _new_graph(self, tokens_ptr: int) -> None:
        tt = ggml.node(tokens_ptr)
        tokens = ggml.view(tt).reshape(-1).tolist()
        T, p0 = len(tokens), self.next_pos
        self.next_pos += T
        lo, hi = self.span if self.span is not None else (0, 1 << 62)
        self.rows = [(i, 0, p0 + i, int(tok)) for i, tok in enumerate(tokens) if lo <= p0 + i < hi]
        self.axes, self.seen, self.pos0 = ggml.Axes(self.g, T), Counter(), p0

    def _ask(self, ptr) -> bool:
        self.g.check(ptr)
        t = ggml.node(ptr)
        op = self.g.op(t)
        if op == "GET_ROWS" and ggml.name(t.src[1]) == "inp_tokens":
            self._new_graph(t.src[1])
        if not self.rows or op in ggml.SHAPE_OPS:
            return False
        nm = t.name.decode(errors="replace")
        k = self.seen[nm]
        self.seen[nm] += 1
        self.pending = None
        m = LAYER.search(nm)
        if self.layers is not None and m and int(m.group(1)) not in self.layers:
            return True   # computed alone all the same: the next node's sources must be read before it runs
        if op == "ROPE" and ggml.name(t.src[1]) == "inp_pos":
            got = ggml.view(ggml.node(t.src[1])).reshape(-1).tolist()
            if got != list(range(self.pos0, self.pos0 + len(got))):
                raise DumpError(f"{nm}: inp_pos {got[:4]}... is not the positions {self.pos0}.. the dump assigned")
        if op == "GET_ROWS" and ggml.name(t.src[1]) == "out_ids":   # every row is an output row, in order
            got = ggml.view(ggml.node(t.src[1])).reshape(-1).tolist()
            if got != list(range(len(got))):
                raise DumpError(f"{nm}: out_ids {got[:4]}... is not every row in order")
        tok, cell = self.axes.of(ptr)
        if not self.g.host(t):
            raise DumpError(f"{nm}: the node is not in host memory (a GPU backend); the dump reads the CPU backend")
        if tok is None and cell is None or not ggml.readable(t):
            self.skipped[op] += 1
            return True
        self.pending = (ptr, nm if k == 0 else f"{nm}#{k}", op, self._sources(t))
        return True

    def _sources(self, t) -> tuple[dict, dict, dict, bool]:
        """(per-row inputs, fixed inputs, weights, src0 is a KV cache view) of node ``t``, copied now."""
        ins, fixed, wts, cache0 = {}, {}, {}, False
        for i, s in enumerate(t.src):
            if not s:
                continue
            st = ggml.node(s)
            key = f"src{i}"
            if _is_weight(st, self.g.op(st)):
                wts[key] = self._weight(st)
                continue
            tok, cell = self.axes.of(s)
            cache0 = cache0 or (i == 0 and tok is None and cell is not None and ggml.name(st.view_src or s).startswith(
                "cache_"))
            if not ggml.readable(st):
                continue
            if tok is not None:
                ins[key] = self._rowcopy(st, tok, cell, leaf=self.g.op(st) == "NONE")
            elif cell is not None:
                fixed[key] = Fixed(ggml.view(st).movedim(3 - cell, 0).clone(), by_position=True)
            else:
                fixed[key] = Fixed(ggml.view(st).clone())
        return ins, fixed, wts, cache0

    def _weight(self, st) -> str:
        nm = st.name.decode(errors="replace")
        if self.store_weights and not self.dw.has_weight(nm):
            w = ggml.view(st)
            while w.dim() > 1 and w.shape[0] == 1:   # ggml's unused outer dims
                w = w[0]
            self.dw.add_weight(nm, w.clone())
        return nm

    def _rowcopy(self, t, tok: int, cell: int | None, leaf: bool = False) -> torch.Tensor:
        """The micro-batch's T rows of node ``t`` [T, ...] (a copy; length-1 axes dropped), cells after each row's
        position zeroed when the node has a cell axis (not on leaves: the mask is kept as set)."""
        T = self.axes.T
        x = ggml.view(t).movedim(3 - tok, 0)[:T].clone()
        if cell is not None and not leaf:
            cdim = (3 - cell) + (1 if 3 - cell < 3 - tok else 0)
            for i in range(T):
                p = self.pos0 + i
                if p + 1 < x.shape[cdim]:
                    x[i].narrow(cdim - 1, p + 1, x.shape[cdim] - p - 1).zero_()
        return x.reshape(T, *[d for d in x.shape[1:] if d != 1])

    def _done(self, ptr) -> bool:
        if self.pending is None or self.pending[0] != ptr:
            return True
        _, site, op, (ins, fixed, wts, cache0) = self.pending
        self.pending = None
        t = ggml.node(ptr)
        if self.on_output is not None:
            self.on_output(self.role, site, ggml.view(t), list(range(self.pos0, self.pos0 + self.axes.T)))
        tok, cell = self.axes.of(ptr)
        if tok is not None:
            y = self._rowcopy(t, tok, cell)
        else:   # cache cells of the micro-batch's positions are its rows
            x = ggml.view(t).movedim(3 - cell, 0)[self.pos0:self.pos0 + self.axes.T].clone()
            y = x.reshape(self.axes.T, *[d for d in x.shape[1:] if d != 1])
        nm = t.name.decode(errors="replace")
        cls = classify(op, nm, wts.get("src0"), cache0)
        if cls == op:
            self.dw.manifest["class_map"].setdefault(op, None)
        names = NAMES.get((op, cls), {})
        ins, wts = ({names.get(k, k): v for k, v in d.items()} for d in (ins, wts))
        meta = {"ggml_op": op, "ggml_name": nm, "ggml_type": self.g.type_name(t),
                "ne": ",".join(str(n) for n in t.ne), "srcs": ",".join(ggml.name(s) for s in t.src if s)}
        params = ggml.op_floats(t)
        meta.update({"eps": params[0]} if op == "RMS_NORM" else {"theta": params[5]} if op == "ROPE" else {})
        if not self.store_weights:
            meta.update({f"weight.{k}": v for k, v in wts.items()})
        kernel = f"ggml.{op}"
        self.dw.add_call(cls, self.role, kernel, self.rows, self.axes.T, inputs=ins, outputs={"y": y},
                         weights=wts if self.store_weights else None, fixed=fixed, site=site, meta=meta,
                         replaces=kernel if self.role == "prompt" else None)
        return True


def _check_args(gguf, ids, n_ubatch, layers, positions, kv_type, n_ctx, gen_tokens) -> None:
    """Raise ValueError naming the first bad argument of dump_llamacpp."""
    if not Path(gguf).is_file():
        raise ValueError(f"GGUF file {str(gguf)!r} does not exist")
    if not ids:
        raise ValueError("prompt_ids is empty; allowed: a non-empty list of token ids")
    for key, v in (("n_ubatch", n_ubatch), ("n_ctx", n_ctx)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} is not allowed; allowed: a positive int")
    if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 0:
        raise ValueError(f"gen_tokens={gen_tokens!r} is not allowed; allowed: an int >= 0")
    if len(ids) + gen_tokens > n_ctx:
        raise ValueError(f"{len(ids)} prompt ids + {gen_tokens} generated tokens do not fit n_ctx={n_ctx}")
    if layers is not None and not all(isinstance(x, int) and x >= 0 for x in layers):
        raise ValueError(f"layers={layers!r} is not allowed; allowed: layer numbers >= 0")
    if positions is not None and not (len(positions) == 2 and 0 <= positions[0] < positions[1]):
        raise ValueError(f"positions={positions!r} is not allowed; allowed: (start, stop) with 0 <= start < stop")
    if kv_type not in KV_TYPES:
        raise ValueError(f"kv_type={kv_type!r} is not allowed; allowed: {', '.join(KV_TYPES)}")


class _Context:
    """A llama.cpp model and context (low-level API) whose graph nodes go to ``callback``."""

    def __init__(self, lc, gguf, callback, n_ubatch, n_batch, n_ctx, n_threads, kv_type):
        from llama_cpp._logger import set_verbose
        set_verbose(False)
        self.C = C = lc.llama_cpp
        C.llama_backend_init()
        self.cb = C.ggml_backend_sched_eval_callback(callback)   # kept: the C side holds a bare pointer
        self.model = C.llama_model_load_from_file(str(gguf).encode(), C.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf}")
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, 1
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.type_k = cp.type_v = KV_TYPES[kv_type]
        cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.cb_eval, cp.cb_eval_user_data = self.cb, None
        self.ctx = C.llama_init_from_model(self.model, cp)
        if not self.ctx:
            C.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not create a context for {gguf}")
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))

    def clear(self) -> None:
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)

    def decode(self, ids: list[int], pos0: int) -> None:
        """One llama_decode of ``ids`` at positions pos0.., logits of every row. Raises RuntimeError."""
        C, b = self.C, self.C.llama_batch_init(len(ids), 0, 1)
        try:
            for i, tok in enumerate(ids):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos0 + i, 1, True
                b.seq_id[i][0] = 0
            b.n_tokens = len(ids)
            rc = C.llama_decode(self.ctx, b)
        finally:
            C.llama_batch_free(b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(ids)} tokens at position {pos0} returned {rc}")

    def argmax_last(self) -> int:
        """The greedy token of the last decoded row (first maximal id)."""
        import numpy as np
        return int(np.ctypeslib.as_array(self.C.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.C.llama_free(self.ctx)
        self.C.llama_model_free(self.model)


def dump_llamacpp(folder, gguf, prompt_ids, n_ubatch: int = 512, layers=None, positions=None,
                  weights: bool = False, gen_tokens: int = 0, n_ctx: int = 4096, n_threads: int = 1,
                  kv_type: str = "f16", on_output=None) -> str:
    """Dump llama.cpp on one prompt: the prompt in micro-batches of ``n_ubatch`` rows (prompt role), then token by
    token from an empty cache and ``gen_tokens`` greedy steps (decode role). Returns the folder.

    Args:
        gguf: a GGUF file of f32/f16/bf16 tensors; prompt_ids: [P] token ids of its vocabulary.
        layers: layer numbers to dump (None: all); positions: (start, stop) (None: all); weights: store the
            weights the calls use; n_ctx, n_threads, kv_type: the context's settings (engines/llamacpp.py's);
            on_output: see Recorder.
    Raises:
        ValueError: a bad argument (named) or a file llama.cpp cannot load; ImportError: no llama-cpp-python;
        FileExistsError: ``folder`` is not empty; DumpError: a node the writer cannot read; RuntimeError: a
        failed llama_decode.
    """
    ids = [int(i) for i in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
    _check_args(gguf, ids, n_ubatch, layers, positions, kv_type, n_ctx, gen_tokens)
    try:
        import llama_cpp as lc
    except ImportError as e:
        raise ImportError("llama.cpp dumps need llama-cpp-python: pip install llama-cpp-python") from e
    meta = {"gguf": str(gguf), "n_ubatch": n_ubatch, "decode": "one token per llama_decode", "n_ctx": n_ctx,
            "n_threads": n_threads, "kv_type": kv_type, "flash_attn": False, "prompt_tokens": len(ids),
            "gen_tokens": gen_tokens, "layers": layers, "positions": list(positions) if positions else None,
            "system_info": lc.llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    with DumpWriter(folder, ENGINE, f"llama-cpp-python {lc.__version__}", meta=meta, shard_bytes=64 << 20) as dw:
        rec = Recorder(dw, layers, positions, weights, on_output)
        cx = _Context(lc, gguf, rec.callback, n_ubatch, max(n_ubatch, len(ids)), n_ctx, n_threads, kv_type)
        try:
            bad = next((i for i in ids if not 0 <= i < cx.n_vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the model's vocabulary of {cx.n_vocab}")
            for role, steps in (("prompt", [ids]), ("decode", [[t] for t in ids])):
                cx.clear()
                rec.start(role)
                for p, chunk in zip(range(0, len(ids), len(steps[0])), steps):
                    _run(cx, rec, chunk, p)
            for g in range(gen_tokens):
                _run(cx, rec, [cx.argmax_last()], len(ids) + g)
        finally:
            cx.close()
        dw.manifest["meta"]["skipped"] = dict(rec.skipped)
    return str(folder)


def _run(cx: _Context, rec: Recorder, chunk: list[int], pos0: int) -> None:
    try:
        cx.decode(chunk, pos0)
    finally:
        if rec.error is not None:
            raise rec.error

