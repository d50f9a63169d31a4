"""llama.cpp as an engine under test: the GGUF export (engines/gguf_export.py) and the adapter (engines/llamacpp.py).

The tiny Qwen3-MoE (engines/tiny.py, bf16) is exported to GGUF and run in llama.cpp; its prompt logits are compared
with our engine's fp32 run of the same folder. Two bounds, each with a planted fault that exceeds it:

    f32 GGUF, f32 KV cache   BOUND_F32 = 1e-4: both sides compute in fp32 from the same (exactly widened) weights
                             and differ only in summation order, ~1e-6 at logits of magnitude ~4 (2^-22 relative
                             is 2^-24 rounding over a few dozen accumulated terms); 1e-4 leaves ~40x margin and is
                             still exceeded by one weight element moved by 2^-7 of its tensor's largest magnitude.
    bf16 GGUF, f16 KV cache  BOUND_BF16 = 2^-4: llama.cpp's defaults. ggml's bf16 matmul rounds its activation input
    (llama.cpp's defaults)   to bf16 (2^-9 relative) and the cache stores K/V in f16 (2^-11); measured ~0.02 at
                             logits ~4. Exceeded by swapping one layer's gate and up expert stacks (a mapping error).

Counts of rows and tokens that differ between micro-batch sizes depend on the CPU (ggml picks other matmul kernels
for batches on some instruction sets), so they are printed (run with -s), never asserted.
"""
import os
import sys

import pytest
import torch

from exactness import exact, paths
from exactness.checkpoint import load_checkpoint
from exactness.engines import NotAvailable, gguf_export, open_engine
from exactness.engines.tiny import save_tiny_qwen3_moe
from exactness.prompts import build_prompt

BOUND_F32 = 1e-4
BOUND_BF16 = 2.0 ** -4
GEN = 32


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, llama_cpp):
    """(folder, {"bf16": gguf, "f32": gguf}) of the tiny model saved in bf16."""
    root = tmp_path_factory.mktemp("llamacpp")
    folder = save_tiny_qwen3_moe(root / "tiny", dtype="bfloat16")
    return folder, {dt: gguf_export.export_gguf(folder, root / f"tiny-{dt}.gguf", dtype=dt) for dt in ("bf16", "f32")}


@pytest.fixture(scope="module")
def prompt():
    return build_prompt("code", max_tokens=48).ids.tolist()


@pytest.fixture(scope="module")
def reference(tiny, prompt):
    """Our engine's fp32 token-by-token run of the tiny folder (cache kept)."""
    w, _ = load_checkpoint(str(tiny[0]), dtype=torch.float32)
    return paths.generate(w, torch.tensor(prompt), GEN, "fast", paths.Schedule("decode"), keep_cache=True)


def _faulty_gguf(folder, path, dtype, fault):
    """A GGUF of ``folder`` with one planted fault applied to the exported tensors (name -> (tensor, matrix))."""
    orig = gguf_export._tensors
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_export, "_tensors", lambda w: fault(orig(w)))
        return gguf_export.export_gguf(folder, path, dtype=dtype)


def _nudge_one_element(t):
    x, matrix = t["blk.1.attn_v.weight"]
    x = x.clone()
    x[0, 0] += 2.0 ** -7 * x.abs().max()
    t["blk.1.attn_v.weight"] = (x, matrix)
    return t


def _swap_gate_up(t):
    g, u = "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight"
    t[g], t[u] = t[u], t[g]
    return t


def _error(a, b, bound):
    """(max |a - b|, (row, col) of it, count above bound) of [P, V] logits."""
    d = (a - b).abs()
    i = int(d.argmax())
    return d.max().item(), divmod(i, d.shape[1]), int((d > bound).sum())


@pytest.mark.parametrize("dtype,kv_type,bound,fault", [("f32", "f32", BOUND_F32, _nudge_one_element),
                                                       ("bf16", "f16", BOUND_BF16, _swap_gate_up)])
def test_gguf_round_trip(tiny, prompt, reference, tmp_path, dtype, kv_type, bound, fault):
    folder, ggufs = tiny
    eng = open_engine(f"llamacpp:{ggufs[dtype]}", ubatch=[1], kv_type=kv_type)
    got = eng.generate(prompt, GEN, "n_ubatch-1")
    mx, at, count = _error(got.prompt_logits, reference.prompt_logits, bound)
    agree = int((got.prompt_logits.argmax(-1) == reference.prompt_logits.argmax(-1)).sum())
    print(f"\n{dtype} GGUF, {kv_type} KV vs our fp32: max {mx:.3g} at {at}, {count} above {bound:g}, "
          f"argmax agrees on {agree}/{len(prompt)} rows, greedy tokens equal: "
          f"{exact.first_differing_row(got.gen_ids, reference.gen_ids) is None}")
    assert count == 0, f"max {mx} at {at}: {count} logits above {bound}"
    bad = open_engine(f"llamacpp:{_faulty_gguf(folder, tmp_path / 'bad.gguf', dtype, fault)}", ubatch=[1],
                      kv_type=kv_type).generate(prompt, GEN, "n_ubatch-1")
    bmx, bat, bcount = _error(bad.prompt_logits, reference.prompt_logits, bound)
    print(f"planted fault {fault.__name__}: max {bmx:.3g} at {bat}, {bcount} above {bound:g}")
    assert bcount > 0, "the planted fault stayed inside the bound: the check cannot see a mis-mapped tensor"


def test_kv_bytes_are_the_cache(tiny, prompt, reference):
    """The parsed llama_state_seq_get_data blob holds K (after norm and RoPE) and V of every position: in f32 it
    agrees with our engine's cache within BOUND_F32; a V read without undoing llama.cpp's transposition does not."""
    eng = open_engine(f"llamacpp:{tiny[1]['f32']}", ubatch=[1], kv_type="f32")
    kv = eng.generate(prompt, GEN, "n_ubatch-1").kv
    T = reference.cache.lengths[0]
    ours = [t[0, :T] for t in reference.cache.k + reference.cache.v]
    assert len(kv) == len(ours) and all(a.shape == b.shape and a.dtype == torch.float32 for a, b in zip(kv, ours))
    errs = [(a - b).abs().max().item() for a, b in zip(kv, ours)]
    print(f"\nKV f32 vs our cache, per K0..K{len(kv) // 2 - 1}, V...: {['%.3g' % e for e in errs]}")
    assert max(errs) <= BOUND_F32
    v = kv[len(kv) // 2]
    wrong = v.reshape(T, -1).t().contiguous().reshape(v.shape)  # the blob's transposed V order, not undone
    assert (wrong - ours[len(kv) // 2]).abs().max().item() > BOUND_F32
    default = open_engine(f"llamacpp:{tiny[1]['bf16']}", ubatch=[1]).generate(prompt, GEN, "n_ubatch-1").kv
    assert all(t.dtype == torch.float16 and t.shape == o.shape for t, o in zip(default, ours))


def test_parse_refuses_other_layouts(tiny, prompt):
    from exactness.engines.llamacpp_kv import parse_seq_state
    eng = open_engine(f"llamacpp:{tiny[1]['bf16']}", ubatch=[1])
    llm = eng._llm("n_ubatch-1")
    eng.generate(prompt, 1, "n_ubatch-1")
    blob = eng.seq_state(llm)
    assert len(parse_seq_state(blob, len(prompt), 2)) == 4
    for bad, n in ((blob[:-1], len(prompt)), (blob + b"\0", len(prompt)), (b"\0" + blob[1:], len(prompt)),
                   (blob, len(prompt) + 1)):
        with pytest.raises(ValueError):
            parse_seq_state(bad, n, 2)


def test_same_configuration_twice_is_byte_equal(tiny, prompt):
    eng = open_engine(f"llamacpp:{tiny[1]['bf16']}", ubatch=[1, 512])
    for config in ("n_ubatch-1", "n_ubatch-512"):
        a, b = eng.generate(prompt, GEN, config), eng.generate(prompt, GEN, config)
        for x, y in [(a.prompt_logits, b.prompt_logits), (a.gen_logits, b.gen_logits), (a.gen_ids, b.gen_ids),
                     *zip(a.kv, b.kv)]:
            assert exact.bytes_equal(x, y), config
    planted = a.prompt_logits.clone()
    planted.view(torch.int32)[5, 7] ^= 1  # one ulp in one logit
    assert not exact.bytes_equal(planted, a.prompt_logits)
    assert exact.differing_rows(planted, a.prompt_logits).nonzero().flatten().tolist() == [5]


def test_ubatch_sizes_measured(tiny, prompt):
    """Rows and tokens that differ from n_ubatch-512 (printed). Asserted: each run's tokens are the argmax of the
    logit rows it returns, and the first token is the argmax of the last prompt row."""
    for dtype in ("bf16", "f32"):
        eng = open_engine(f"llamacpp:{tiny[1][dtype]}", ubatch=[1, 7, 16, 512])
        runs = {c.name: eng.generate(prompt, GEN, c.name) for c in eng.configurations()}
        base = runs["n_ubatch-512"]
        for name, g in runs.items():
            assert g.gen_logits.shape == (GEN, eng.n_vocab) and g.prompt_logits.shape == (len(prompt), eng.n_vocab)
            assert torch.equal(g.gen_logits.argmax(-1), g.gen_ids)
            assert exact.bytes_equal(g.gen_logits[0], g.prompt_logits[-1])
            rows = int(exact.differing_rows(g.prompt_logits, base.prompt_logits).sum())
            toks = int((g.gen_ids != base.gen_ids).sum())
            kv = [exact.first_differing_row(a, b) for a, b in zip(g.kv, base.kv)]
            print(f"\n{dtype} GGUF {name} vs n_ubatch-512: {rows}/{len(prompt)} prompt rows differ, {toks}/{GEN} "
                  f"greedy tokens differ (first at {exact.first_differing_row(g.gen_ids, base.gen_ids)}), first "
                  f"differing KV position per K/V tensor {kv}")


def test_resumed_and_drafted_token_by_token_equal_generate(tiny, prompt):
    """With n_ubatch 1 every row is its own micro-batch whatever the request, so a prompt resumed from llama.cpp's
    saved state, and drafted decoding, must give generate()'s bytes."""
    eng = open_engine(f"llamacpp:{tiny[1]['bf16']}", ubatch=[1, 512])
    fresh = eng.generate(prompt, GEN, "n_ubatch-1")
    res = eng.resumed(prompt[:20], prompt, GEN, "n_ubatch-1")
    assert exact.bytes_equal(res.prompt_logits, fresh.prompt_logits)
    assert exact.bytes_equal(res.gen_logits, fresh.gen_logits) and exact.bytes_equal(res.gen_ids, fresh.gen_ids)
    dr = eng.drafted(prompt, GEN, "n_ubatch-1")
    assert exact.bytes_equal(dr.gen_ids, fresh.gen_ids) and exact.bytes_equal(dr.gen_logits, fresh.gen_logits)
    base = eng.generate(prompt, GEN, "n_ubatch-512")
    for name, g in (("resumed", eng.resumed(prompt[:20], prompt, GEN, "n_ubatch-512")),
                    ("drafted", eng.drafted(prompt, GEN, "n_ubatch-512"))):
        print(f"\n{name} n_ubatch-512 vs generate: tokens first differ at "
              f"{exact.first_differing_row(g.gen_ids, base.gen_ids)}, "
              f"{int(exact.differing_rows(g.gen_logits, base.gen_logits).sum())}/{GEN} logit rows differ")
    with pytest.raises(ValueError, match="prefix"):
        eng.resumed(prompt[1:20], prompt, GEN, "n_ubatch-1")
    with pytest.raises(NotAvailable):
        eng.concurrent([prompt, prompt], GEN, "n_ubatch-1")


def test_options_and_identity(tiny):
    path = tiny[1]["bf16"]
    eng = open_engine(f"llamacpp:{path}", steps=[7, 16], device="cpu", dtype="bfloat16")
    assert [c.name for c in eng.configurations()] == ["n_ubatch-1", "n_ubatch-7", "n_ubatch-16", "n_ubatch-512"]
    text = "def f(x):\n\treturn x  # \u00fc \u20ac <|exactness_bos|>"
    assert eng.oracle == "n_ubatch-1" and eng.encode(text) == [256, *text.encode("utf-8")]
    ident = eng.identity()
    assert ident["kind"] == "llamacpp" and len(ident["model"]["sha256"]) == 64
    assert ident["configurations"]["n_ubatch-7"]["n_ubatch"] == 7
    sel = open_engine(f"llamacpp:{path}", configurations=["n_ubatch-3", "n_ubatch-1"], oracle="n_ubatch-3")
    assert [c.name for c in sel.configurations()] == ["n_ubatch-1", "n_ubatch-3"] and sel.oracle == "n_ubatch-3"
    for options, match in (({"nope": 1}, "nope"), ({"ubatch": [0]}, "ubatch"), ({"ubatch": [1], "configurations":
                           ["n_ubatch-1"]}, "not both"), ({"configurations": ["chunk-7"]}, "chunk-7"),
                           ({"kv_type": "q8"}, "q8"), ({"oracle": "n_ubatch-9", "ubatch": [1]}, "n_ubatch-9")):
        with pytest.raises(ValueError, match=match):
            open_engine(f"llamacpp:{path}", **options)
    with pytest.raises(ValueError, match="n_ubatch-2"):
        eng.generate([1, 2], 1, "n_ubatch-2")
    with pytest.raises(ValueError, match="n_ctx"):
        open_engine(f"llamacpp:{path}", ubatch=[1], n_ctx=8).generate(list(range(8)), 4, "n_ubatch-1")
    with pytest.raises(ValueError, match="GGUF"):
        open_engine("llamacpp:/nonexistent.gguf")


def test_export_refusals(tiny, tmp_path):
    folder = tiny[0]
    with pytest.raises(ValueError, match="f16"):
        gguf_export.export_gguf(folder, tmp_path / "x.gguf", dtype="f16")
    with pytest.raises(FileExistsError):
        gguf_export.export_gguf(folder, tiny[1]["bf16"])
    other = save_tiny_qwen3_moe(tmp_path / "nonorm", norm_topk_prob=False, num_hidden_layers=1)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        gguf_export.export_gguf(other, tmp_path / "nonorm.gguf")
    from safetensors.torch import load_file, save_file
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(ValueError, match="q_norm"):
        gguf_export.export_gguf(missing, tmp_path / "missing.gguf")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text((folder / "config.json").read_text().replace('"qwen3_moe"', '"llama"'))
    with pytest.raises(ValueError, match="model_type"):
        gguf_export.export_gguf(llama, tmp_path / "llama.gguf")


def test_without_llama_cpp_installed(monkeypatch):
    """The adapter's module imports without llama-cpp-python; using it raises ImportError with the install line."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    monkeypatch.delitem(sys.modules, "exactness.engines.llamacpp", raising=False)
    from exactness.engines import llamacpp
    with pytest.raises(ImportError, match="pip install llama-cpp-python"):
        llamacpp.LlamaCppEngine.from_spec(os.devnull, {"ubatch": [1]})
