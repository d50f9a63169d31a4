"""Tensor dumps (exactness.dumps): the reader rejects each defect with one line, our invariant set dumps clean,
planted faults are located with the right class and site, and the dump contract agrees with a brute-force byte
comparison on a transformers dump."""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from brute import _raw
from exactness.analysis.calls import engine_calls, open_calls
from exactness.analysis.contract.calls import contract_of_calls
from exactness.analysis.contract.report import render_calls_md
from exactness.analysis.fp64.calls import fp64_of_calls
from exactness.analysis.fp64.report import render_calls_md as fp64_md
from exactness.dumps.format import DumpError
from exactness.dumps.reader import read_dump
from exactness.dumps.writer import DumpWriter
from exactness.dumps.hf_hooks import dump_hf_model
from exactness.dumps.ours import dump_engine
from exactness.prompts import build_prompt
from faults import row0_perturbed, row0_rmsnorm_perturbed

ROOT = Path(__file__).resolve().parents[1]
STEP = 8


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=32).ids


def _small_set(folder, decode_y=None, fp8=False, decode_scale=1.0) -> str:
    """Two prompt rows (one call of M=3) and their two decode calls, class dense, plus an unpaired decode row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    w = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    y = torch.nn.functional.linear(x, w)
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    with DumpWriter(folder, "toy", "b1", class_map={"gemm": "dense"}) as dw:
        dw.add_weight("w", w)
        sc = {"y": torch.ones(3)} if fp8 else None
        dw.add_call("gemm", "prompt", "toy.tiled", [(0, 0, 7, 1), (2, 0, 9, 3)], 3, inputs={"x": x},
                    outputs={"y": y.to(dt)}, weights={"w": "w"}, replaces="toy.gemv", site="wq", scales=sc)
        for r, pos in ((0, 7), (2, 9), (1, 8)):
            yd = y[r:r + 1] if decode_y is None or pos != 9 else decode_y(y[r:r + 1])
            dw.add_call("dense", "decode", "toy.gemv", [(0, 0, pos, 1)], 1, inputs={"x": x[r:r + 1]},
                        outputs={"y": yd.to(dt)}, weights={"w": "w"}, site="wq",
                        scales={"y": torch.full((1,), decode_scale if pos == 9 else 1.0)} if fp8 else None)
    return str(folder)


def _edit(folder, fn) -> None:
    p = os.path.join(folder, "manifest.json")
    with open(p) as fh:
        m = json.load(fh)
    fn(m)
    with open(p, "w") as fh:
        json.dump(m, fh)


def _shrink_tensor(folder) -> None:
    f = os.path.join(folder, "tensors-00000.safetensors")
    t = load_file(f)
    t["c0.o.y"] = t["c0.o.y"][:1].clone()
    save_file(t, f)


def _drop_tensor(folder) -> None:
    f = os.path.join(folder, "tensors-00000.safetensors")
    t = load_file(f)
    del t["c0.i.x"]
    save_file(t, f)


DEFECTS = {
    "missing file": (lambda d: os.remove(os.path.join(d, "tensors-00000.safetensors")), "is missing from"),
    "missing tensor": (_drop_tensor, "tensor 'c0.i.x' is missing from tensors-00000.safetensors"),
    "shape mismatch": (_shrink_tensor, "shape mismatch: tensor 'c0.o.y' has shape [1, 5], the call dumps 2 row(s)"),
    "unknown class": (lambda d: _edit(d, lambda m: m["calls"][1].update({"class": "matmul"})),
                      "call 1: unknown class 'matmul'"),
    "unknown dtype": (lambda d: _edit(d, lambda m: m["calls"][0]["outputs"]["y"].update({"dtype": "bf17"})),
                      "unknown dtype 'bf17'"),
    "row claimed twice": (lambda d: _edit(d, lambda m: m["calls"][3]["rows"][0].__setitem__(2, 9)),
                          "call 3 (dense decode wq): row (seq 0, pos 9) is also claimed by call 2"),
    "version mismatch": (lambda d: _edit(d, lambda m: m.update({"version": 2})),
                         "version mismatch: the set is version 2, this reader reads version 1"),
    "unknown weight": (lambda d: _edit(d, lambda m: m["calls"][0]["weights"].update({"w": "w2"})),
                       "names 'w2', which is not in weights"),
    "row index out of range": (lambda d: _edit(d, lambda m: m["calls"][0]["rows"][0].__setitem__(0, 3)),
                               "call 0 (gemm prompt wq): dumped row index 3 is outside 0..2 (call_rows 3)"),
    "row not four integers": (lambda d: _edit(d, lambda m: m["calls"][0]["rows"][0].__setitem__(2, 7.0)),
                              "call 0 (gemm prompt wq): row entry [0, 0, 7.0, 1] is not a [row, seq, pos, token]"),
    "file with a folder part": (lambda d: _edit(d, lambda m: m["calls"][0]["outputs"]["y"].update(
        {"file": "./tensors-00000.safetensors"})), "file './tensors-00000.safetensors' has a folder part"),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_reader_rejects_each_defect_in_one_line(tmp_path, defect):
    folder = _small_set(tmp_path / "set")
    read_dump(folder)                                     # control: the intact set reads
    corrupt, expected = DEFECTS[defect]
    corrupt(folder)
    with pytest.raises(DumpError) as e:
        read_dump(folder)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_writer_refuses_bad_calls(tmp_path):
    with pytest.raises(DumpError, match="first dim must be call_rows=3"):
        DumpWriter(tmp_path / "a", "toy").add_call("dense", "prompt", "k", [(0, 0, 0, 0)], 3,
                                                   outputs={"y": torch.zeros(2, 4)}, replaces="d")
    with pytest.raises(DumpError, match="role must be one of"):
        DumpWriter(tmp_path / "b", "toy").add_call("dense", "prefill", "k", [(0, 0, 0, 0)], 1,
                                                   outputs={"y": torch.zeros(1, 4)})
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        DumpWriter(tmp_path / "c", "toy")


@pytest.mark.parametrize("fp8", [False, True])
def test_contract_on_a_small_set_clean_and_planted(tmp_path, fp8):
    clean = contract_of_calls(_small_set(tmp_path / "clean", fp8=fp8), progress=False)
    assert clean["totals"] == {"paired": 2, "mismatches": 0, "origin_mismatches": 0, "unpaired_prompt": 0,
                               "unpaired_decode": 1}
    bump = (lambda y: (y.float() * 1.5).to(y.dtype)) if fp8 else (lambda y: y * (1 + 2 ** -7))
    bad = contract_of_calls(_small_set(tmp_path / "bad", decode_y=bump, fp8=fp8), progress=False)
    f = bad["first_mismatch"]
    assert bad["totals"]["mismatches"] == 1 and bad["first_origin"] == f
    assert (f["class"], f["site"], f["pos"], f["row"], f["call_rows"], f["inputs_equal"]) == ("dense", "wq", 9, 2, 3,
                                                                                             True)
    assert (f["prompt_kernel"], f["replaces"], f["decode_kernel"]) == ("toy.tiled", "toy.gemv", "toy.gemv")
    assert (f["ulp"] is None) if fp8 else f["ulp"] >= 1
    assert "`dense`, site `wq`" in render_calls_md(bad)


def test_an_fp8_scale_alone_differing_is_a_mismatch(tmp_path):
    obj = contract_of_calls(_small_set(tmp_path / "s", fp8=True, decode_scale=2.0), progress=False)
    f = obj["first_mismatch"]
    assert obj["totals"]["mismatches"] == 1 and (f["pos"], f["output"]) == (9, "y.scale"), f


def test_a_source_of_calls_is_a_folder_or_a_read_set_and_nothing_else(tmp_path):
    """The contract and FP64 of recorded calls give the same result from a folder and from its read DumpSet; any
    other source is refused in one line."""
    folder = _small_set(tmp_path / "bad", decode_y=lambda y: y * (1 + 2 ** -7))
    ds = open_calls(folder)
    assert open_calls(ds) is ds
    assert contract_of_calls(ds, progress=False) == contract_of_calls(folder, progress=False)
    assert fp64_of_calls(ds, progress=False) == fp64_of_calls(Path(folder), progress=False)
    with pytest.raises(TypeError, match="^source list is not a source of kernel calls; allowed: a dump folder"):
        contract_of_calls([folder], progress=False)


def test_deep_plan_and_a_position_subset_pair_every_row(tmp_path, tiny_weights):
    ids = build_prompt("code", max_tokens=140).ids
    keep = [0, 3, 63, 64, 65, 100, 139]           # around the deep plan's 64-row dense tiles
    calls = engine_calls(tmp_path / "deep", tiny_weights, ids, "invariant", positions=keep, path="deep",
                         deep_threshold=16)      # our engine's recorded calls as the source
    obj = contract_of_calls(calls, progress=False)
    assert obj["totals"]["mismatches"] == 0 and obj["totals"]["unpaired_prompt"] == 0
    routed = [s for s in obj["sites"] if s["class"].startswith("expert") and ".e" in s["site"]]
    assert all(s["paired"] == len(keep) for s in obj["sites"] if s not in routed)
    for layer in ("L0", "L1"):   # top-2 routing: each kept row reaches two routed experts per layer
        assert sum(s["paired"] for s in routed if s["site"].startswith(layer + ".")) == 2 * 2 * len(keep)
    assert obj["meta"]["path"] == "deep"


def test_our_invariant_set_dumps_clean_and_a_planted_fault_is_located(tmp_path, tiny_weights, ids):
    clean = contract_of_calls(dump_engine(tmp_path / "inv", tiny_weights, ids, "invariant", step=STEP), progress=False)
    assert clean["totals"]["mismatches"] == 0 and clean["totals"]["unpaired_prompt"] == 0
    covered = {c["class"] for c in clean["classes"] if c["paired"]}
    assert covered == {c["class"] for c in clean["classes"]} - {"argmax"}
    assert clean["totals"]["paired"] == sum(c["prompt_rows"] for c in clean["classes"])
    # negative control: RMSNorm's prompt kernel perturbed on row 0 of every call of more than one row
    bad = contract_of_calls(dump_engine(tmp_path / "bad", tiny_weights, ids, row0_rmsnorm_perturbed(), step=STEP),
                            progress=False)
    f = bad["first_origin"]
    assert bad["first_mismatch"] == f
    assert (f["class"], f["site"], f["row"], f["pos"], f["call_rows"]) == ("rmsnorm", "L0.attn_norm", 0, 0, STEP)
    assert f["prompt_kernel"] == "invariant.rmsnorm.prompt" and f["decode_kernel"] == "invariant.rmsnorm.decode"
    site = next(s for s in bad["sites"] if s["site"] == "L0.attn_norm")
    assert site["positions"] == ",".join(str(p) for p in range(0, ids.numel(), STEP))
    origins = {(s["class"], s["site"]) for s in bad["sites"] if s["origin_mismatches"]}
    assert {c for c, _ in origins} == {"rmsnorm"}, origins
    # FP64: the invariant set's outputs lie within their class bounds; a dense kernel scaled by 9/8 on row 0 does not
    ok = {r["class"]: r for r in fp64_of_calls(tmp_path / "inv", progress=False)["rows"]}
    for cls in ("dense", "router", "expert_gate_up", "expert_down", "attention", "lm_head"):
        assert ok[cls]["over_bound"] == 0 and ok[cls]["bound_use"] <= 1, (cls, ok[cls])
    scaled = row0_perturbed("dense", lambda t: t * 1.125, roles=("prompt",))
    worse = fp64_of_calls(dump_engine(tmp_path / "d64", tiny_weights, ids, scaled, step=STEP), progress=False)
    d = next(r for r in worse["rows"] if r["class"] == "dense")
    assert d["over_bound"] > 0 and d["bound_use"] > 1
    assert (d["worst"]["role"], d["worst"]["row"], d["worst"]["pos"] % STEP) == ("prompt", 0, 0), d["worst"]


def _brute_site_counts(folder) -> dict:
    """(class, site) -> rows whose outputs differ, by plain bytes comparison over the reader's tensors."""
    ds = read_dump(folder)
    dec = {(c.cls, c.site, s, p): (c, j) for c in ds.calls if c.role == "decode"
           for j, (_, s, p, _) in enumerate(c.rows)}
    out = {}
    for c in (c for c in ds.calls if c.role == "prompt"):
        po = ds.tensors(c, "outputs")
        for k, (_, s, p, _) in enumerate(c.rows):
            d, j = dec[(c.cls, c.site, s, p)]
            do = ds.tensors(d, "outputs")
            differ = any(_raw(po[n][k]) != _raw(do[n][j]) for n in po)
            out[(c.cls, c.site)] = out.get((c.cls, c.site), 0) + differ
    return out


def _positions(ranges: str) -> set[int]:
    """"1-3,7" -> {1, 2, 3, 7}."""
    out = set()
    for part in filter(None, ranges.split(",")):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def _script():
    spec = importlib.util.spec_from_file_location("dump_hf", ROOT / "scripts" / "dump_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_hf_dump_contract_agrees_with_brute_force_and_locates_a_planted_fault(tmp_path):
    from transformers import AutoModelForCausalLM

    from exactness.engines.tiny import save_tiny_qwen3_moe
    model_dir = save_tiny_qwen3_moe(tmp_path / "model")
    assert _script().main([str(model_dir), str(tmp_path / "hf"), "--tokens", "24"]) == 0
    obj = contract_of_calls(tmp_path / "hf", progress=False)
    assert {s["class"] for s in obj["sites"]} == {"dense", "attention", "rmsnorm", "router", "moe_combine", "lm_head",
                                                  "rope", "residual"}
    brute = _brute_site_counts(tmp_path / "hf")
    assert {(s["class"], s["site"]): s["mismatches"] for s in obj["sites"]} == brute   # CPU-dependent counts, agreed
    assert obj["totals"]["mismatches"] == sum(brute.values())
    fp = fp64_of_calls(tmp_path / "hf", progress=False)    # the fused experts call has no per-expert inputs: skipped
    assert {r["class"] for r in fp["rows"]} == {"dense", "router", "attention", "rmsnorm", "lm_head", "rope",
                                                "residual"}
    assert [s["class"] for s in fp["skipped"]] == ["moe_combine"] and "Not evaluated" in fp64_md(fp)
    # negative control: layer 0's input RMSNorm changed on prompt row 5 (calls of more than one row)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def fault(mod, args, out):
        if out.shape[1] > 1:
            out = out.clone()
            out[0, 5] = out[0, 5] * (1 + 2 ** -7)
        return out
    handle = model.model.layers[0].input_layernorm.register_forward_hook(fault)
    dump_hf_model(tmp_path / "hf_bad", model, build_prompt("code", max_tokens=24).ids)
    handle.remove()
    bad = contract_of_calls(tmp_path / "hf_bad", progress=False)
    f = bad["first_mismatch"]    # layer 0's input norm is the first call: its inputs are the embeddings
    assert (f["class"], f["site"], f["inputs_equal"]) == ("rmsnorm", "L0.input_layernorm", True)
    site = next(s for s in bad["sites"] if s["site"] == "L0.input_layernorm")
    assert 5 in _positions(site["positions"]) and site["origin_mismatches"] >= 1
    assert {(s["class"], s["site"]): s["mismatches"] for s in bad["sites"]} == _brute_site_counts(tmp_path / "hf_bad")


def test_the_dumps_section_runs_from_the_receipt_runner_and_the_command_line(tmp_path, capsys):
    """DUMPS=DIR runs the dumps section only (contract + FP64 from the dump set); `contract --dumps DIR` and
    `fp64 --dumps DIR` compute each half; a folder that is not a dump set is refused before anything runs."""
    import json

    from exactness.receipt.cli import main
    from exactness.receipt.runner import ReceiptError, run_receipts
    bad = _small_set(tmp_path / "bad", decode_y=lambda y: y * (1 + 2 ** -7))
    res = run_receipts("ci", tmp_path / "r", {"dumps": bad})
    data = json.loads((res.folder / "receipt.json").read_text())
    assert list(data["sections"]) == ["dumps"] and data["env"]["dumps"] == bad and data["env"]["kernel_sets"] is None
    assert data["sections"]["dumps"]["contract"]["totals"]["mismatches"] == 1
    assert "## Tensor dumps" in (res.folder / "receipt.md").read_text()
    assert main(["contract", "--dumps", bad, "--out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["first_mismatch"]["pos"] == 9
    with pytest.raises(ReceiptError, match="is not a dump set; allowed: a folder holding manifest.json"):
        run_receipts("ci", tmp_path / "r2", {"dumps": str(tmp_path)})
