"""Dumps of a transformers Qwen3-MoE: forward hooks on its modules write every kernel call to a DumpWriter.

Hooked modules, their engine class names and our classes (``CLASS_MAP``; sites name the module):
    q_proj, k_proj, v_proj, o_proj   linear        -> dense         site ``L0.q_proj``
    the attention function           attention     -> attention     site ``L0.attn``: transformers calls it as a
                                                                    function (``ALL_ATTENTION_FUNCTIONS``), so the
                                                                    dumper wraps the model's implementation there
                                                                    while it is attached; q rows, k_cache and
                                                                    v_cache of sequence 0 [T, Hkv, D] (by
                                                                    position), output y
    input/post_attention_layernorm, q_norm, k_norm, model.norm
                                     rms_norm      -> rmsnorm       site ``L0.q_norm``, ``final_norm``
    mlp.gate (Qwen3MoeTopKRouter)    topk_router   -> router        outputs logits, weights, idx
    mlp.experts (Qwen3MoeExperts)    fused_experts -> moe_combine   one fused call: routed experts' SwiGLU and
                                                                    the weighted sum; inputs x, idx, g
    lm_head                          lm_head       -> lm_head
    apply_rotary_pos_emb             rope          -> rope          sites ``L0.rope_q``, ``L0.rope_k``: the model
                                                                    module's function, wrapped there while attached;
                                                                    inputs x, cos, sin, positions
    the decoder layer's two adds     residual      -> residual      sites ``L0.residual_attn``, ``L0.residual_moe``:
                                                                    a TorchDispatchMode (``residual_mode``) records
                                                                    each aten.add of two [B, S, H] tensors inside a
                                                                    decoder layer; inputs a (the residual), b

Rows: a module's input [B, S, ...] (or [B*S, ...]) is read as B*S rows in row-major order; the driver announces
each forward's rows (sequence, position, token) with :meth:`HFDumper.forward_rows`. :func:`dump_hf_model` runs
one forward over the whole prompt (prompt role) and then the prompt token by token through a DynamicCache (decode
role). Hooks see the output later hooks and the next module see: a hook registered before the dumper (a planted
fault) is dumped as the module's output.
"""
from __future__ import annotations

import inspect
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .writer import DumpWriter, Fixed

ENGINE = "transformers"
CLASS_MAP = {"linear": "dense", "attention": "attention", "rms_norm": "rmsnorm", "topk_router": "router",
             "fused_experts": "moe_combine", "lm_head": "lm_head", "rope": "rope", "residual": "residual"}
RESIDUAL_SITES = ("residual_attn", "residual_moe")


def hooked_modules(model) -> list[tuple[str, str, str, object]]:
    """(engine class, site, module name, module) of every module HFDumper hooks, in forward order.

    Raises:
        ValueError: a model without the Qwen3-MoE layout (``model.model.layers[i].self_attn/.mlp.gate/.experts``).
    """
    try:
        layers = model.model.layers
        out = []
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            out += [("rms_norm", f"L{i}.input_layernorm", layer.input_layernorm)]
            out += [("linear", f"L{i}.{n}", getattr(a, n)) for n in ("q_proj", "k_proj", "v_proj")]
            out += [("rms_norm", f"L{i}.{n}", getattr(a, n)) for n in ("q_norm", "k_norm")]
            out += [("linear", f"L{i}.o_proj", a.o_proj), ("rms_norm", f"L{i}.post_attention_layernorm",
                                                           layer.post_attention_layernorm),
                    ("topk_router", f"L{i}.gate", mlp.gate), ("fused_experts", f"L{i}.experts", mlp.experts)]
        out += [("rms_norm", "final_norm", model.model.norm), ("lm_head", "lm_head", model.lm_head)]
    except AttributeError as e:
        raise ValueError(f"not a Qwen3-MoE causal LM (self_attn, mlp.gate, mlp.experts per layer): {e}") from None
    names = {id(m): n for n, m in model.named_modules()}
    return [(c, s, names.get(id(m), s), m) for c, s, m in out]


class HFDumper:
    """Forward hooks writing each hooked module call to ``writer``; :meth:`remove` takes them off.

    Args:
        writer: a DumpWriter made with ``class_map=CLASS_MAP``; model: a transformers Qwen3MoeForCausalLM.
        weights: store the modules' weights in the dump set (by parameter name) and reference them.
        positions: positions to dump (None = all).
    """

    def __init__(self, writer: DumpWriter, model, weights: bool = True, positions=None):
        self.dw, self.store_weights = writer, weights
        self.keep = None if positions is None else {int(p) for p in positions}
        self.role, self.rows, self.B = None, [], 0
        self.handles, self._attn, self._rope = [], None, None
        self.layer, self.adds, self.hidden = None, 0, model.config.hidden_size
        for ecls, site, name, mod in hooked_modules(model):
            self.handles.append(mod.register_forward_hook(self._hook(ecls, site, name)))
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda *_, i=i: self._enter_layer(i)))
            self.handles.append(layer.register_forward_hook(lambda *_: self._enter_layer(None)))
        self._wrap_attention(model)
        self._wrap_rope(model)

    def _enter_layer(self, i) -> None:
        self.layer, self.adds = i, 0

    def residual_mode(self) -> TorchDispatchMode:
        """A dispatch mode recording the residual adds; enter it around the forwards (a mode entered before it,
        outside, sees the adds first: a planted fault there is dumped as the add's output)."""
        return _ResidualAdds(self)

    def forward_rows(self, role: str, rows: list[tuple[int, int, int]], batch: int = 1) -> None:
        """Announce the next forward: its role and its B*S rows as (sequence, position, token), row-major."""
        self.role, self.rows, self.B = role, [tuple(int(v) for v in r) for r in rows], batch

    def remove(self) -> None:
        """Take every hook off the model."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._attn is not None:
            table, impl, before = self._attn
            if before is None:
                del table[impl]
            else:
                table[impl] = before
            self._attn = None
        if self._rope is not None:
            mod, orig = self._rope
            mod.apply_rotary_pos_emb = orig
            self._rope = None

    def _wrap_rope(self, model) -> None:
        """Wrap the model module's ``apply_rotary_pos_emb`` (called by name from its attention) while attached."""
        mod = sys.modules[type(model).__module__]
        orig = getattr(mod, "apply_rotary_pos_emb", None)
        if orig is None:
            return
        rp = getattr(model.config, "rope_parameters", None) or {}
        theta = float(rp.get("rope_theta", getattr(model.config, "rope_theta", 0.0)) or 0.0)
        kernel = f"{ENGINE}.{getattr(orig, '__name__', 'apply_rotary_pos_emb')}"

        def rope(q, k, cos, sin, *args, **kw):
            qe, ke = orig(q, k, cos, sin, *args, **kw)   # q, k [B, h, S, D]; cos, sin [B, S, D]
            pos = torch.tensor([r[1] for r in self.rows], dtype=torch.int64)
            for n, x, y in (("q", q, qe), ("k", k, ke)):
                self._add("rope", f"L{self.layer}.rope_{n}", None, None, {"x": x.transpose(1, 2), "cos": cos,
                          "sin": sin, "positions": pos}, {"y": y.transpose(1, 2)}, {"theta": theta}, kernel)
            return qe, ke
        mod.apply_rotary_pos_emb = rope
        self._rope = (mod, orig)

    def _wrap_attention(self, model) -> None:
        """Override the model's attention implementation in its module's ALL_ATTENTION_FUNCTIONS (a local entry of
        that table, removed by :meth:`remove`) with a wrapper that dumps each call."""
        mod = sys.modules[type(model).__module__]
        table, impl = mod.ALL_ATTENTION_FUNCTIONS, model.config._attn_implementation
        orig = table.get_interface(impl, mod.eager_attention_forward)
        before = table._local_mapping.get(impl)
        kernel = f"{ENGINE}.{getattr(orig, '__name__', impl)}"

        def attention(module, query, key, value, attention_mask, **kw):
            out, w = orig(module, query, key, value, attention_mask, **kw)   # query [B, Hq, S, D], out [B, S, Hq, D]
            fixed = {"k_cache": Fixed(key[0].transpose(0, 1), True), "v_cache": Fixed(value[0].transpose(0, 1), True)}
            self._add("attention", f"L{module.layer_idx}.attn", None, None, {"q": query.transpose(1, 2)},
                      {"y": out}, {"scaling": float(kw.get("scaling") or 0.0)}, kernel, fixed)
            return out, w
        table[impl] = attention
        self._attn = (table, impl, before)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] or [B*S, ...] -> [B*S, ...] (the forward's rows, row-major)."""
        n = len(self.rows)
        if t.dim() >= 2 and t.shape[0] == self.B and t.shape[0] * t.shape[1] == n:
            return t.reshape(n, *t.shape[2:])
        if t.dim() >= 1 and t.shape[0] == n:
            return t
        raise ValueError(f"a hooked tensor of shape {tuple(t.shape)} does not hold the forward's {n} rows")

    def _selected(self):
        return [(i, *r) for i, r in enumerate(self.rows) if self.keep is None or r[1] in self.keep]

    def _weights(self, name: str, mod) -> dict:
        if not self.store_weights:
            return {}
        out = {}
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{name}.{pname}"
            if not self.dw.has_weight(full):
                self.dw.add_weight(full, p.detach())
            out[pname] = full
        return out

    def _add(self, ecls, site, name, mod, inputs: dict, outputs: dict, meta=None, kernel=None, fixed=None) -> None:
        if self.role is None:
            raise ValueError("HFDumper: forward_rows(role, rows) must announce each forward before it runs")
        rows = self._selected()
        if rows:
            kernel = kernel or f"{ENGINE}.{type(mod).__name__}"
            self.dw.add_call(ecls, self.role, kernel, rows, len(self.rows),
                             inputs={k: self._flat(v) for k, v in inputs.items()},
                             outputs={k: self._flat(v) for k, v in outputs.items()},
                             weights=self._weights(name, mod) if mod is not None else {},
                             replaces=kernel if self.role == "prompt" else None, site=site, meta=meta,
                             fixed=fixed if self.B == 1 else None)

    def _hook(self, ecls, site, name):
        def hook(mod, args, out):
            if ecls == "topk_router":
                ins, outs = {"x": args[0]}, dict(zip(("logits", "weights", "idx"), out))
            elif ecls == "fused_experts":
                ins, outs = {"x": args[0], "idx": args[1], "g": args[2]}, {"y": out}
            else:
                ins, outs = {"x": args[0]}, {"y": out}
            meta = {k: getattr(mod, a) for k, a in (("eps", "variance_epsilon"), ("top_k", "top_k"),
                                                    ("norm", "norm_topk_prob")) if hasattr(mod, a)}
            self._add(ecls, site, name, mod, ins, outs, meta)
        return hook


class _ResidualAdds(TorchDispatchMode):
    """Records aten.add.Tensor of two [B, S, H] tensors inside a decoder layer (its residual adds) to a dumper."""

    def __init__(self, dumper: HFDumper):
        super().__init__()
        self.d = dumper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        d = self.d
        if func is torch.ops.aten.add.Tensor and d.layer is not None and not kwargs and len(args) == 2 and \
                all(isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[-1] == d.hidden for a in args):
            k, d.adds = d.adds, d.adds + 1
            site = f"L{d.layer}." + (RESIDUAL_SITES[k] if k < len(RESIDUAL_SITES) else f"residual{k}")
            d._add("residual", site, None, None, {"a": args[0], "b": args[1]}, {"y": out}, None,
                   f"{ENGINE}.aten.add")
        return out


def dump_hf_model(folder, model, prompt_ids: torch.Tensor, weights: bool = True, positions=None,
                  build: str | None = None) -> str:
    """Dump a transformers Qwen3-MoE on one prompt: one forward over all P tokens (prompt role), then the tokens one
    at a time through a DynamicCache (decode role). Returns the folder.

    Args:
        model: Qwen3MoeForCausalLM (any dtype/device, eval mode); prompt_ids: [P] int64.
        weights: also store the hooked modules' weights; positions: positions to dump (None = all).
        build: the engine's build id (default: the transformers and torch versions).
    Raises:
        ValueError: a model without the Qwen3-MoE layout; FileExistsError: ``folder`` is not empty.
    """
    import transformers
    from transformers import DynamicCache
    ids = prompt_ids.to(torch.int64).reshape(-1).cpu()
    dev = next(model.parameters()).device
    build = build or f"transformers {transformers.__version__}, torch {torch.__version__}"
    meta = {"model": type(model).__name__, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "prompt_tokens": ids.numel()}
    with DumpWriter(folder, ENGINE, build, class_map=CLASS_MAP, meta=meta) as dw:
        d = HFDumper(dw, model, weights, positions)
        try:
            with torch.no_grad(), d.residual_mode():
                d.forward_rows("prompt", [(0, p, int(t)) for p, t in enumerate(ids)])
                model(input_ids=ids[None].to(dev), use_cache=False)
                cache = DynamicCache(config=model.config)
                # the cache keyword this transformers takes (``cache`` in newer releases, ``past_key_values`` before)
                kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
                for p, t in enumerate(ids.tolist()):
                    d.forward_rows("decode", [(0, p, t)])
                    model(input_ids=ids[None, p:p + 1].to(dev), position_ids=torch.tensor([[p]], device=dev),
                          use_cache=True, **{kw: cache})
        finally:
            d.remove()
    return str(folder)
