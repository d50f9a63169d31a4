"""transformers dumps record RoPE (the model module's apply_rotary_pos_emb) and the decoder layers' residual adds
(a TorchDispatchMode), so that a fault planted in either is located at its op: the site where a mismatch with
byte-equal inputs appears, at the planted position, and nowhere else in that class.

RoPE and the adds are elementwise, so their prompt rows equal their decode rows whenever their inputs do: a clean
dump has no mismatch with equal inputs in either class (the matmuls before them may differ by batch on a CPU,
which the contract then reports as carried-in differences, not as RoPE's or the add's own).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from exactness.analysis.contract.calls import contract_of_calls
from exactness.dumps.reader import read_dump
from exactness.dumps.hf_hooks import dump_hf_model
from exactness.prompts import build_prompt

P = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from exactness.engines.tiny import save_tiny_qwen3_moe
    folder = save_tiny_qwen3_moe(tmp_path_factory.mktemp("hf_ops") / "tiny")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=P).ids


def _origins(rep, cls):
    """{site: positions} of the mismatches of ``cls`` whose inputs were byte-equal."""
    return {s["site"]: s["origin_positions"] for s in rep["sites"] if s["class"] == cls and s["origin_mismatches"]}


def _ulp(t, idx):
    """``t`` with one ULP added to element ``idx`` (a copy)."""
    t = t.clone()
    t.view(torch.int16)[idx] += 1
    return t


def test_rope_and_residual_adds_are_dumped_and_clean(model, ids, tmp_path):
    import transformers.models.qwen3_moe.modeling_qwen3_moe as m
    before = m.apply_rotary_pos_emb      # a function, or (newer transformers) a module object without __name__
    rep = contract_of_calls(dump_hf_model(tmp_path / "clean", model, ids), progress=False)
    by = {c["class"]: c for c in rep["classes"]}
    L = model.config.num_hidden_layers
    for cls, per_layer in (("rope", 2), ("residual", 2)):
        assert by[cls]["prompt_rows"] == by[cls]["paired"] == per_layer * L * P, cls
        assert _origins(rep, cls) == {}, cls
    sites = {s["site"] for s in rep["sites"]}
    assert {f"L{i}.{n}" for i in range(L) for n in ("rope_q", "rope_k", "residual_attn", "residual_moe")} <= sites
    ds = read_dump(tmp_path / "clean")
    rope = next(c for c in ds.calls if c.cls == "rope" and c.role == "prompt")
    assert set(rope.refs["inputs"]) == {"x", "cos", "sin", "positions"} and rope.meta["theta"] == 1e6
    assert m.apply_rotary_pos_emb is before                            # the wrapper is removed


def test_planted_rope_fault_is_located_at_rope(model, ids, tmp_path, monkeypatch):
    import transformers.models.qwen3_moe.modeling_qwen3_moe as m
    orig, calls = m.apply_rotary_pos_emb, []

    def faulty(q, k, cos, sin, *a, **kw):   # layer 1's RoPE of q, prompt forward (S > 1), position 5
        qe, ke = orig(q, k, cos, sin, *a, **kw)
        if q.shape[2] > 1:
            calls.append(1)
            if len(calls) == 2:
                qe = _ulp(qe, (0, 0, 5, 0))
        return qe, ke
    monkeypatch.setattr(m, "apply_rotary_pos_emb", faulty)
    rep = contract_of_calls(dump_hf_model(tmp_path / "rope", model, ids), progress=False)
    assert _origins(rep, "rope") == {"L1.rope_q": "5"}
    assert m.apply_rotary_pos_emb is faulty


class _PlantAdd(TorchDispatchMode):
    """One ULP on the first add of two [1, S, H] tensors with S > 1 (layer 0's attention residual), row 7."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden, self.done = hidden, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.add.Tensor and not self.done and len(args) == 2 and all(
                isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[1] > 1 and a.shape[2] == self.hidden
                for a in args):
            self.done = True
            out = _ulp(out, (0, 7, 3))
        return out


def test_planted_residual_fault_is_located_at_the_add(model, ids, tmp_path):
    plant = _PlantAdd(model.config.hidden_size)
    with plant:
        folder = dump_hf_model(tmp_path / "res", model, ids)
    assert plant.done
    rep = contract_of_calls(folder, progress=False)
    assert _origins(rep, "residual") == {"L0.residual_attn": "7"}
    assert _origins(rep, "rope") == {}
    norm = next(s for s in rep["sites"] if s["site"] == "L0.post_attention_layernorm")
    assert norm["mismatches"] >= 1   # the fault is carried on: the norm reads it
