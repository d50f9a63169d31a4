"""llama.cpp op dumps (dumps/llamacpp.py): every computed ggml node of a prompt run (prompt role, micro-batches of
n_ubatch rows) and of the same prompt token by token (decode role), through ggml's eval callback.

Asserted: an identical pair (n_ubatch 1 against token by token) has 0 differing rows in every class; one ULP
planted in one node's output (through the callback, so later nodes compute on it) is located at that node, site
and position, with byte-equal inputs, at n_ubatch 1 and at n_ubatch 512; the reader validates the sets; layer and
position selection; one-line errors. Which op first breaks at n_ubatch 512 depends on the CPU's kernels: printed.
"""
import json
import shutil

import pytest
import torch

from exactness.analysis.contract.calls import contract_of_calls
from exactness.analysis.contract.report import render_calls_md
from exactness.dumps.format import DumpError
from exactness.dumps.reader import read_dump

P = 12
CLASSES = ("dense", "router", "expert_gate_up", "expert_down", "moe_combine", "attention", "rmsnorm", "rope",
           "residual", "lm_head")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")
    from exactness.engines import gguf_export
    from exactness.engines.tiny import save_tiny_qwen3_moe
    root = tmp_path_factory.mktemp("dumps_llamacpp")
    return gguf_export.export_gguf(save_tiny_qwen3_moe(root / "tiny", dtype="bfloat16"), root / "tiny.gguf",
                                   dtype="bf16")


@pytest.fixture(scope="module")
def ids():
    from exactness.prompts import build_prompt
    return build_prompt("code", max_tokens=P).ids.tolist()


def _dump(folder, gguf, ids, **kw):
    from exactness.dumps.llamacpp import dump_llamacpp
    return dump_llamacpp(folder, gguf, ids, **kw)


def _plant(site: str, pos: int):
    """An on_output hook adding one ULP to element 0 of the row at ``pos`` of node ``site`` (prompt role)."""
    hits = []

    def on_output(role, s, y, positions):
        if role == "prompt" and s == site and pos in positions:
            i = positions.index(pos)
            iv = y.view(torch.int32)
            idx = [0, 0, 0, 0]
            ax = next(a for a in range(4) if y.shape[a] == len(positions)) if len(positions) > 1 else 0
            idx[ax] = i
            iv[tuple(idx)] += 1
            hits.append(s)
    return on_output, hits


def _positions(ranges: str) -> set:
    """"1-3,7" -> {"1", "2", "3", "7"}."""
    out = set()
    for part in filter(None, ranges.split(",")):
        a, _, b = part.partition("-")
        out |= {str(p) for p in range(int(a), int(b or a) + 1)}
    return out


def test_identical_pair_has_no_differing_rows(gguf, ids, tmp_path):
    folder = _dump(tmp_path / "u1", gguf, ids, n_ubatch=1)
    ds = read_dump(folder)
    assert {c.role for c in ds.calls} == {"prompt", "decode"}
    rep = contract_of_calls(folder, progress=False)
    by = {c["class"]: c for c in rep["classes"]}
    for cls in CLASSES:
        assert by[cls]["paired"] > 0 and by[cls]["status"] == "byte-exact", cls
    assert rep["totals"]["mismatches"] == 0 and rep["totals"]["unpaired_prompt"] == 0
    assert rep["first_mismatch"] is None and by["MUL"]["paired"] > 0   # ggml ops without a class of ours
    assert json.load(open(folder + "/manifest.json"))["class_map"]["MUL"] is None


@pytest.mark.parametrize("ubatch,site,cls,pos", [(1, "ffn_moe_gate-1", "expert_gate_up", 5),
                                                 (1, "Kcur-1#1", "rope", 9),
                                                 (1, "ffn_moe_swiglu-0", "GLU", 2),
                                                 (512, "norm-0", "rmsnorm", 3),
                                                 (512, "attn_norm-0", "MUL", 6)])
def test_planted_ulp_is_located_at_its_op(gguf, ids, tmp_path, ubatch, site, cls, pos):
    """The planted node is the first mismatch with equal inputs. At n_ubatch 512 the planted nodes are layer 0's
    norms, which run before any matmul: on every CPU their inputs are byte-equal in both roles."""
    hook, hits = _plant(site, pos)
    layer = int(site.split("#")[0].rsplit("-", 1)[1])   # only the planted node's layer is written
    folder = _dump(tmp_path / "planted", gguf, ids, n_ubatch=ubatch, on_output=hook, layers=[layer])
    assert hits == [site]
    rep = contract_of_calls(folder, progress=False)
    rec = next(s for s in rep["sites"] if s["site"] == site)
    assert rec["class"] == cls and str(pos) in _positions(rec["origin_positions"])
    first = rep["first_origin"]
    assert (first["class"], first["site"], first["pos"], first["call_rows"]) == (cls, site, pos, min(ubatch, P))
    assert first["inputs_equal"] is True and first["element"] == 0 and first["ulp"] == 1
    assert rep["first_mismatch"] == first


def test_ubatch_512_against_token_by_token(gguf, ids, tmp_path):
    """The first op whose prompt row differs from its decode row with byte-equal inputs (printed: CPU-dependent)."""
    folder = _dump(tmp_path / "u512", gguf, ids, n_ubatch=512, gen_tokens=2)
    rep = contract_of_calls(folder, progress=False)
    by = {c["class"]: c for c in rep["classes"]}
    decode_pos = {r[2] for c in read_dump(folder).calls if c.role == "decode" for r in c.rows}
    assert decode_pos == set(range(P + 2)) and rep["totals"]["unpaired_prompt"] == 0
    assert rep["totals"]["unpaired_decode"] == 2 * sum(c["decode_rows"] for c in rep["classes"]) // (P + 2)
    assert all(by[c]["paired"] == by[c]["prompt_rows"] > 0 for c in CLASSES)
    assert all(list(by[c]["sizes"]) == [str(P)] for c in CLASSES)
    first = rep["first_origin"]
    if rep["totals"]["mismatches"]:
        assert rep["first_mismatch"] is not None
    if first is not None:
        assert first["inputs_equal"] is True and first["call_rows"] == P
    print("\n" + render_calls_md(rep).split("\n\n")[2])
    print("first mismatch with equal inputs:", first and {k: first[k] for k in ("class", "site", "pos", "ulp")})


def test_layer_and_position_selection(gguf, ids, tmp_path):
    folder = _dump(tmp_path / "sel", gguf, ids, n_ubatch=4, layers=[1], positions=(4, 9))
    ds = read_dump(folder)
    assert {r[2] for c in ds.calls for r in c.rows} == set(range(4, 9))
    sites = {c.site for c in ds.calls}
    assert "ffn_moe_gate-1" in sites and "norm" in sites and not any(s.split("#")[0].endswith("-0") for s in sites)
    assert contract_of_calls(folder, progress=False)["totals"]["unpaired_prompt"] == 0


def test_reader_refuses_an_unknown_mapped_class(gguf, ids, tmp_path):
    folder = _dump(tmp_path / "ok", gguf, ids[:3], n_ubatch=1, layers=[0])
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    m = json.load(open(bad / "manifest.json"))
    m["class_map"]["MUL"] = "bogus"
    json.dump(m, open(bad / "manifest.json", "w"))
    with pytest.raises(DumpError, match="unknown class 'bogus'"):
        read_dump(bad)


@pytest.mark.parametrize("kw,match", [({"n_ubatch": 0}, "n_ubatch=0"), ({"positions": (5, 2)}, "positions"),
                                      ({"layers": [-1]}, "layers"), ({"kv_type": "q4_0"}, "kv_type"),
                                      ({"gen_tokens": -1}, "gen_tokens")])
def test_bad_arguments_one_line(gguf, ids, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match) as e:
        _dump(tmp_path / "x", gguf, ids, **kw)
    assert "\n" not in str(e.value)


def test_bad_ids_and_files_one_line(gguf, ids, tmp_path):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _dump(tmp_path / "y", gguf, [1, 10 ** 6])
    with pytest.raises(ValueError, match="does not exist"):
        _dump(tmp_path / "z", tmp_path / "none.gguf", ids)


def test_engine_option_dumps_each_configuration_once(gguf, ids, tmp_path):
    from exactness.engines import open_engine
    eng = open_engine(f"llamacpp:{gguf}", ubatch=[1, 512], dumps=str(tmp_path / "d"))
    g = eng.generate(ids, 2, "n_ubatch-512")
    ds = read_dump(g.info["dumps"])
    assert ds.manifest["meta"]["n_ubatch"] == 512 and g.info["dumps"].endswith("n_ubatch-512")
    assert "dumps" not in eng.generate(ids, 2, "n_ubatch-512").info   # the first prompt only
    with pytest.raises(ValueError, match="dumps"):
        open_engine(f"llamacpp:{gguf}", ubatch=[1], dumps=5)


def test_fp64_reads_the_recommended_names(gguf, ids, tmp_path):
    """Mapped nodes carry the names docs/dumps.md recommends (x, w, a, b, eps, theta): RoPE and the residual adds
    are within their FP64 bound; the bf16 matmuls are evaluated (ggml rounds their f32 input to bf16 first)."""
    from exactness.analysis.fp64.calls import fp64_of_calls
    folder = _dump(tmp_path / "w", gguf, ids, n_ubatch=512, weights=True, layers=[0])
    rows = {r["class"]: r for r in fp64_of_calls(folder, progress=False)["rows"]}
    assert rows["rope"]["over_bound"] == 0 and rows["residual"]["over_bound"] == 0
    assert rows["dense"]["rows"] > 0 and rows["lm_head"]["rows"] == 2 * P
    c = next(c for c in read_dump(folder).calls if c.cls == "rmsnorm")
    assert set(c.refs["inputs"]) == {"x"} and c.meta["eps"] == pytest.approx(1e-6)
