"""The transformers adapter on the tiny random Qwen3-MoE (bf16, CPU): the oracle's determinism, the adapter's rows
against the model's own computation, planted faults the comparisons catch, the optional abilities and the errors
bad options get. Every configuration is deterministic; differences between configurations depend on the CPU's
kernels: they are measured and printed (run with -s), never asserted."""
import copy
import hashlib
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from exactness import exact  # noqa: E402
from exactness.engines import open_engine  # noqa: E402
from exactness.engines.hf import TransformersEngine  # noqa: E402
from exactness.engines.tiny import save_tiny_qwen3_moe  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs."
P, G = 48, 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("hf") / "tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def engine(folder):
    return TransformersEngine.from_spec(str(folder), {"steps": [7, 16]})


@pytest.fixture(scope="module")
def ids(engine):
    ids = engine.encode(TEXT)[:P]
    assert len(ids) == P and ids[0] == 256  # BOS, then bytes
    return ids


@pytest.fixture(scope="module")
def runs(engine, ids):
    """One Run per configuration."""
    return {c.name: engine.generate(ids, G, c.name) for c in engine.configurations()}


def run_differences(a, b) -> list[str]:
    """What differs in bytes between two Runs (empty: the same run)."""
    out = []
    if not exact.bytes_equal(a.gen_ids, b.gen_ids):
        out.append(f"gen_ids from {exact.first_differing_row(a.gen_ids, b.gen_ids)}")
    for name in ("prompt_logits", "gen_logits"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and not exact.bytes_equal(x, y)):
            out.append(f"{name} differ")
    firsts = [exact.first_differing_row(x, y) for x, y in zip(a.kv, b.kv)]
    if len(a.kv) != len(b.kv) or any(f is not None for f in firsts):
        out.append(f"kv from position {min((f for f in firsts if f is not None), default=-1)}")
    return out


def flip_low_bit(t: torch.Tensor, index) -> torch.Tensor:
    """A copy of ``t`` with the lowest bit of element ``index`` flipped (one ulp)."""
    t = t.clone()
    exact.as_int(t)[index] ^= 1
    return t


def direct(model, ids, chunk, gen_tokens):
    """The model's own defaults, written here: the prompt in chunks through a DynamicCache without position ids or
    mask (the model derives positions from the cache), then greedy decode. -> (gen [G], prompt rows [P, V] fp32,
    gen rows [G, V] fp32, kv as the adapter lays it out)."""
    cache, x = DynamicCache(config=model.config), torch.tensor([ids])
    # the cache keyword this transformers takes (``cache`` in newer releases, ``past_key_values`` before)
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    with torch.inference_mode():
        plog = torch.cat([model(input_ids=x[:, a:a + chunk], use_cache=True, **kw).logits[0].float()
                          for a in range(0, len(ids), chunk)])
        gen, glog, last = [], [], plog[-1]
        for i in range(gen_tokens):
            if i:
                last = model(input_ids=torch.tensor([[gen[-1]]]), use_cache=True, **kw).logits[0, -1].float()
            gen.append(int(last.argmax()))
            glog.append(last)
    kv = [l.keys[0].transpose(0, 1) for l in cache.layers] + [l.values[0].transpose(0, 1) for l in cache.layers]
    return torch.tensor(gen), plog, torch.stack(glog), kv


def test_oracle_is_deterministic_and_the_comparison_catches_one_ulp(engine, ids, runs):
    again = engine.generate(ids, G, "token-by-token")
    assert run_differences(runs["token-by-token"], again) == []
    for field, index in (("prompt_logits", (5, 3)), ("gen_logits", (9, 100)), ("kv", None)):
        bad = copy.copy(again)
        if field == "kv":
            bad.kv = list(again.kv)
            bad.kv[3] = flip_low_bit(again.kv[3], (10, 1, 4))  # layer 1 values, position 10
            assert exact.first_differing_row(runs["token-by-token"].kv[3], bad.kv[3]) == 10
        else:
            setattr(bad, field, flip_low_bit(getattr(again, field), index))
        assert run_differences(runs["token-by-token"], bad) != [], field


@pytest.mark.parametrize("config,chunk", [("token-by-token", 1), ("one-forward", P), ("chunk-7", 7),
                                          ("chunk-16", 16)])
def test_loop_rows_are_the_models_own_computation(engine, ids, runs, config, chunk):
    gen, plog, glog, kv = direct(engine.model, ids, chunk, G)
    got = runs[config]
    assert exact.bytes_equal(got.gen_ids, gen)
    assert exact.bytes_equal(got.prompt_logits, plog) and exact.bytes_equal(got.gen_logits, glog)
    assert all(exact.bytes_equal(a, b) for a, b in zip(got.kv, kv)) and len(got.kv) == len(kv) == 4
    assert got.prompt_logits.dtype == torch.float32 and got.prompt_logits.shape == (P, 258)
    assert got.kv[0].shape == (P + G - 1, 2, 16)  # the last generated token is not fed


def test_one_forward_rows_equal_a_plain_forward_without_cache(engine, ids, runs):
    with torch.inference_mode():
        plain = engine.model(torch.tensor([ids])).logits[0]
    assert plain.dtype == torch.bfloat16
    assert exact.bytes_equal(runs["one-forward"].prompt_logits, plain.float())
    assert exact.bytes_equal(runs["one-forward"].prompt_logits.bfloat16(), plain)  # the upcast is exact


def test_a_planted_weight_fault_is_caught(engine, ids, runs):
    """lm_head row v scaled by 2: every logit of column v doubles exactly (a power of two commutes with rounding),
    nothing else moves; the comparison with the clean model must say so."""
    clean = runs["token-by-token"]
    v = int(clean.gen_ids[0])
    faulty = copy.deepcopy(engine.model)
    with torch.no_grad():
        faulty.lm_head.weight[v] *= 2
    bad = TransformersEngine(faulty, configurations=["token-by-token"]).generate(ids, G, "token-by-token")
    rows = exact.differing_rows(bad.prompt_logits, clean.prompt_logits)
    assert int(rows.sum()) == int((clean.prompt_logits[:, v] != 0).sum()) > 0
    others = torch.ones(258, dtype=torch.bool)
    others[v] = False
    assert exact.bytes_equal(bad.prompt_logits[:, others], clean.prompt_logits[:, others])
    assert exact.bytes_equal(bad.prompt_logits[:, v].contiguous(), clean.prompt_logits[:, v] * 2)
    assert run_differences(clean, bad) != []
    assert all(exact.bytes_equal(a[:P], b[:P]) for a, b in zip(bad.kv, clean.kv))  # the cache is upstream of lm_head


def test_generate_configurations(engine, ids, runs):
    for name in ("generate", "generate-chunk-7", "generate-chunk-16"):
        g = runs[name]
        assert g.gen_ids.shape == (G,) and g.gen_logits.shape == (G, 258) and g.prompt_logits is None
        assert g.kv[0].shape == (P + G - 1, 2, 16) and len(g.token_times) == G
        assert exact.bytes_equal(g.gen_ids, g.gen_logits.argmax(-1))  # greedy over the rows it returned


def test_end_of_sequence_is_not_a_stop(engine, ids, runs):
    model = copy.deepcopy(engine.model)
    model.generation_config.eos_token_id = model.config.eos_token_id = int(runs["generate"].gen_ids[0])
    eng = TransformersEngine(model, configurations=["generate"])
    g = eng.generate(ids, G, "generate")
    assert exact.bytes_equal(g.gen_ids, runs["generate"].gen_ids)
    assert eng.model.generation_config.eos_token_id == int(runs["generate"].gen_ids[0])  # restored


def test_drafted_resumed_concurrent(engine, ids, runs):
    d = engine.drafted(ids, G, "generate")
    assert d.gen_ids.shape == (G,) and d.gen_logits.shape == (G, 258) and d.info["drafted"] == "prompt lookup"
    r = engine.resumed(ids[:20], ids, G, "token-by-token")
    assert run_differences(runs["token-by-token"], r) == []  # the same forwards on the same cache contents
    assert r.info["resumed_from"] == 20
    rg = engine.resumed(ids[:20], ids, G, "generate")
    assert rg.gen_ids.shape == (G,)
    prompts = [ids, ids[:30], ids[5:]]
    many = engine.concurrent(prompts, G, "chunk-7")
    assert len(many) == 3
    for g, p in zip(many, prompts):
        assert g.gen_ids.shape == (G,) and g.prompt_logits.shape == (len(p), 258)
        assert g.kv[0].shape == (len(p) + G - 1, 2, 16) and not torch.isnan(g.gen_logits).any()
    assert len(engine.concurrent(prompts, G, "generate")) == 3


def test_bad_input_is_refused_by_name(folder, engine, ids):
    cases = [({"kernel_sets": ["fast"]}, "'kernel_sets'"), ({"dtype": "float16"}, "allowed: bfloat16, float32"),
             ({"device": "tpu"}, "allowed: cpu, cuda"), ({"steps": [0]}, "positive integers"),
             ({"configurations": ["chunk-0"]}, "unknown transformers configuration 'chunk-0'"),
             ({"draft": str(folder / "nowhere")}, "not a model folder")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            TransformersEngine.from_spec(str(folder), options)
    with pytest.raises(ValueError, match="not a model folder"):
        TransformersEngine.from_spec(str(folder / "nowhere"), {})
    with pytest.raises(ValueError, match="no configuration 'chunk-5'.*token-by-token"):
        engine.generate(ids, G, "chunk-5")
    with pytest.raises(ValueError, match="proper, non-empty prefix"):
        engine.resumed(ids[1:5], ids, G, "token-by-token")
    with pytest.raises(ValueError, match="gen_tokens"):
        engine.generate(ids, 0, "token-by-token")
    with pytest.raises(ValueError, match=r"token ids in \[0, 258\)"):
        engine.generate([1, 300], G, "token-by-token")


def test_spec_identity_and_encoding(folder):
    eng = open_engine(f"transformers:{folder}", steps=[16], configurations=["one-forward"])
    assert [c.name for c in eng.configurations()] == ["token-by-token", "one-forward"]
    ident = eng.identity()
    assert ident["kind"] == "transformers" and ident["model_class"] == "Qwen3MoeForCausalLM"
    assert ident["config_sha256"] == hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    assert ident["weights_sha256"] == {
        "model.safetensors": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()}
    assert ident["dtype"] == "bfloat16" and ident["configurations"]["one-forward"]["prefill_chunk"] is None
    assert eng.encode("ab") == [256, 97, 98]


class MaskDropped(TransformersEngine):
    """A planted fault: the attention mask never reaches the model, so padded rows attend to their padding."""

    def _forward(self, ids, pos, mask, cache):
        return super()._forward(ids, pos, None, cache)


def batch_vs_alone(engine, prompts, config) -> tuple[float, int, int]:
    """Largest |logit difference| between each padded-batch row and the prompt run alone, over the prompt rows and
    the generated rows before the first differing token -> (max, argmax prompt, rows compared)."""
    worst, where, rows = 0.0, -1, 0
    for i, (m, a) in enumerate(zip(engine.concurrent(prompts, 8, config), [engine.generate(p, 8, config)
                                                                          for p in prompts])):
        k = exact.first_differing_row(m.gen_ids, a.gen_ids)
        d = torch.cat([(m.prompt_logits - a.prompt_logits).abs(), (m.gen_logits - a.gen_logits)[:k].abs()])
        rows += d.shape[0]
        if float(d.max()) > worst:
            worst, where = float(d.max()), i
    return worst, where, rows


def test_padded_batch_rows_match_alone_within_fp32_rounding(tmp_path, capsys):
    """fp32: every row of a left-padded batch within BOUND of its prompt run alone (the differences are the
    rounding of other matrix shapes); with the mask dropped the padded rows break the bound."""
    bound = 1e-4  # logits of magnitude ~4; fp32 rounding of the tiny model's sums stays near 1e-5
    folder = save_tiny_qwen3_moe(tmp_path / "fp32", dtype="float32")
    eng = TransformersEngine.from_spec(str(folder), {"dtype": "float32", "configurations": ["chunk-7"]})
    ids = eng.encode(TEXT)[:P]
    prompts = [ids, ids[:30], ids[5:]]
    worst, where, rows = batch_vs_alone(eng, prompts, "chunk-7")
    bad, bad_where, _ = batch_vs_alone(MaskDropped(eng.model, configurations=["chunk-7"]), prompts, "chunk-7")
    with capsys.disabled():
        print(f"\npadded batch vs alone, fp32 chunk-7: max |diff| {worst:.3g} (prompt {where}, {rows} rows), "
              f"bound {bound}; mask dropped: {bad:.3g} (prompt {bad_where})")
    assert worst <= bound < bad


def _rows_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows of ``a`` and ``b`` whose bytes differ, counted one row at a time (the printed figures' cross-check)."""
    return sum(not exact.bytes_equal(x, y) for x, y in zip(a, b))


def test_every_configuration_is_deterministic_and_its_differences_measured(engine, ids, runs, folder, tmp_path):
    """Every configuration, drafted run and concurrent run gives the same bytes when run again (what holds on every
    CPU); how far each is from the oracle depends on the CPU's kernels, so it is printed (-s), computed from these
    runs, never asserted."""
    oracle = runs["token-by-token"]
    for name, g in runs.items():
        assert run_differences(g, engine.generate(ids, G, name)) == [], name
    lines = []
    for name, g in runs.items():
        gen = int(exact.differing_rows(g.gen_logits, oracle.gen_logits).sum())
        assert gen == _rows_differing(g.gen_logits, oracle.gen_logits)
        prompt = "-"
        if g.prompt_logits is not None:
            prompt = int(exact.differing_rows(g.prompt_logits, oracle.prompt_logits).sum())
            assert prompt == _rows_differing(g.prompt_logits, oracle.prompt_logits)
        kv = min((f for f in (exact.first_differing_row(a, b) for a, b in zip(g.kv, oracle.kv)) if f is not None),
                 default=None)
        lines.append(f"{name:18s} prompt rows differ {prompt}/{P} gen rows differ {gen}/{G} first token diff "
                     f"{exact.first_differing_row(g.gen_ids, oracle.gen_ids)} kv first diff {kv}")
    assert lines[0].startswith("token-by-token") and f"differ 0/{P} gen rows differ 0/{G}" in lines[0]
    draft = save_tiny_qwen3_moe(tmp_path / "draft", seed=1, num_hidden_layers=1)
    assisted = TransformersEngine.from_spec(str(folder), {"draft": str(draft), "configurations": ["generate"]})
    for label, eng in (("assistant model", assisted), ("prompt lookup", engine)):
        d = eng.drafted(ids, G, "generate")
        assert d.gen_ids.shape == (G,) and d.info["drafted"] == label
        assert run_differences(d, eng.drafted(ids, G, "generate")) == [], label
        lines.append(f"drafted, {label}: first token diff vs generate "
                     f"{exact.first_differing_row(d.gen_ids, runs['generate'].gen_ids)}, gen rows differ "
                     f"{_rows_differing(d.gen_logits, runs['generate'].gen_logits)}/{G}")
    prompts = [ids, ids[:30], ids[5:]]
    for name in ("token-by-token", "one-forward", "generate"):
        many = engine.concurrent(prompts, G, name)
        assert [run_differences(a, b) for a, b in zip(many, engine.concurrent(prompts, G, name))] == [[]] * 3, name
        alone = [runs[name]] + [engine.generate(p, G, name) for p in prompts[1:]]
        lines.append(f"concurrent {name}: first token diff vs alone "
                     f"{[exact.first_differing_row(m.gen_ids, s.gen_ids) for m, s in zip(many, alone)]}")
    print("\n" + "\n".join(lines))
