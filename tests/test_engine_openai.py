"""The ``openai`` engine over real HTTP on 127.0.0.1: against ``python -m exactness serve`` launched by the adapter
(a subprocess) and one in a thread, the received tokens equal in-process paths.generate's; streamed equals
non-streamed; top logprobs equal log_softmax of the in-process rows; each failure mode raises EngineError."""
from __future__ import annotations

import sys

import httpx
import pytest
import torch

from exactness.analysis.engines_bench import bench_engine
from exactness.engines import open_engine
from exactness.engines.base import Engine, EngineError, NotAvailable
from exactness.engines.openai import OpenAIEngine
from exactness.exact import bytes_equal, first_differing_row, token_hash
from exactness.kernels import get_set
from exactness.paths import Schedule, generate
from exactness.engines.serve import Served, create_app
from exactness.tokenizer import ByteTokenizer
from http_servers import DYING_SERVER, ThreadServer, fake_app, free_port

GEN = 12
LP_BOUND = 1e-5
LAUNCH = (f"{sys.executable} -m exactness serve --preset tiny --kernels invariant --path batched --step 16 "
          "--port {port}")
SCHEDULES = {"batched-16": ("invariant", Schedule("batched", 16)), "decode": ("invariant", Schedule("decode"))}


@pytest.fixture(scope="module")
def engine(tiny_weights):
    """Two configurations: the served decode path in a thread (the oracle) and the batched-16 path launched."""
    m = Served("tiny", tiny_weights, ByteTokenizer(), get_set("invariant"), Schedule("decode"))
    with ThreadServer(create_app(m)) as s:
        eng = OpenAIEngine.from_spec("", {"configurations": [{"name": "decode", "base_url": s.url + "/v1"},
                                                             {"name": "batched-16", "launch": LAUNCH}],
                                          "oracle": "decode", "timeout_s": 60, "device": "cpu", "steps": [16]})
        yield eng
        eng.close()
        assert eng.endpoints["batched-16"].proc.poll() is not None   # stopped by its PID


@pytest.fixture(scope="module")
def prompt(code_prompt):
    return code_prompt.ids[:40].tolist()


def test_tokens_equal_in_process_generate(engine, tiny_weights, prompt):
    assert isinstance(engine, Engine) and engine.oracle == "decode"
    assert engine.capabilities >= {"concurrent", "top_logprobs", "token_ids"}
    assert not engine.capabilities & {"prompt_logits", "gen_logits", "kv_bytes", "drafted", "prompt_cache"}
    for config, (ks, sched) in SCHEDULES.items():
        ref = generate(tiny_weights, torch.tensor(prompt), GEN, ks, sched).gen_ids
        g = engine.generate(prompt, GEN, config)
        assert token_hash(g.gen_ids) == token_hash(ref) and bytes_equal(g.gen_ids, ref), config
        assert g.info["gen_ids_are"] == "token ids" and g.info["finish_reason"] == "length"
        assert g.greedy is True and g.info["greedy_check"] == {"positions": GEN}
        assert len(g.token_times) == GEN and g.ttft_s > 0 and g.decode_s >= 0
        assert g.token_times == sorted(g.token_times)
        plan = "decode" if sched.path == "decode" else "batched"
        assert g.info["served"][plan] == {"segments": len(prompt) // (sched.step or 1) + (sched.path != "decode"),
                                          "rows": len(prompt)}
        # negative control: a corrupted token list is caught, at its index
        bad = g.gen_ids.clone()
        bad[GEN - 1] = (bad[GEN - 1] + 1) % 258
        assert token_hash(bad) != token_hash(ref) and first_differing_row(bad, ref) == GEN - 1


def test_text_prompts_through_detokenize(engine, tiny_weights, prompt):
    eng = OpenAIEngine.from_spec(engine.endpoints["decode"].base_url, {"token_ids": False, "top_logprobs": 0})
    assert "token_ids" not in eng.capabilities and "top_logprobs" not in eng.capabilities
    assert prompt[0] == 256   # BOS, then bytes: the text round trip gives the same ids
    ref = generate(tiny_weights, torch.tensor(prompt), 8, "invariant", Schedule("decode")).gen_ids
    g = eng.generate(prompt, 8, "server")
    assert bytes_equal(g.gen_ids, ref) and g.top_logprobs is None and g.info["usage"]["prompt_tokens"] == len(prompt)


def test_prompt_logprobs_over_http_match_in_process_prompt_rows(engine, tiny_weights, prompt):
    """exactness serve answers vLLM's prompt_logprobs: each row is log_softmax of the in-process prompt logit row
    (fp32) before that token; decode and batched-16 (invariant kernels) give byte-equal rows, compared as the
    engines section compares them; one planted ulp in one row is named with that row."""
    from exactness.analysis.engines import compare
    prompt = prompt[:33]   # a prompt not run before on this engine: its first run per configuration asks
    gens = {c: engine.generate(prompt, 4, c) for c in SCHEDULES}
    assert engine.generate(prompt, 4, "decode").prompt_logprobs is None   # asked once per configuration and prompt
    assert "prompt_logprobs" in engine.capabilities
    g = gens["batched-16"]
    assert g.info["prompt_logprobs_via"] == "vllm" and g.prompt_logprobs.dtype == torch.float64
    assert g.prompt_logprobs.shape == (len(prompt) - 1, 1 + 5) == g.prompt_logprob_ids.shape
    run = generate(tiny_weights, torch.tensor(prompt), 1, "invariant", Schedule("batched", 16))
    ref = torch.log_softmax(run.prompt_logits.float(), dim=-1)[:-1]                    # [P-1, V]
    assert torch.equal(g.prompt_logprob_ids[:, 0], torch.tensor(prompt[1:]))
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].double()
    assert torch.equal(g.prompt_logprobs[:, 0], want)                                  # the fp32 value, exactly
    assert torch.equal(g.prompt_logprobs[:, 1:], torch.topk(ref, 5).values.double())
    row = compare(g, gens["decode"])
    assert row["prompt_logprobs_equal"] is True and row["prompt_logprob_rows_differing"] == 0, row["verdict"]
    bad = gens["decode"]
    bad.prompt_logprobs = bad.prompt_logprobs.clone()
    bad.prompt_logprobs[7, 0] = torch.nextafter(bad.prompt_logprobs[7, 0], torch.tensor(0.0, dtype=torch.float64))
    row = compare(g, bad)
    assert row["prompt_logprobs_equal"] is False and row["first_differing_prompt_logprob_row"] == 7
    assert row["prompt_logprob_rows_differing"] == 1 and "prompt logprobs" in row["verdict"]


def test_streamed_equals_non_streamed(engine, prompt):
    g = engine.generate(prompt, GEN, "batched-16")
    url = engine.endpoints["batched-16"].base_url + "/completions"
    r = httpx.post(url, json={"prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True},
                   timeout=60).json()
    assert bytes_equal(torch.tensor(r["choices"][0]["token_ids"], dtype=torch.int64), g.gen_ids)


def test_top_logprobs_match_in_process_rows(engine, tiny_weights, prompt):
    run = generate(tiny_weights, torch.tensor(prompt), GEN, "invariant", Schedule("batched", 16))
    ref = torch.log_softmax(run.gen_logits.float(), dim=-1)                        # [G, V] fp32
    g = engine.generate(prompt, GEN, "batched-16")
    assert len(g.top_logprobs) == GEN
    err = max(abs(lp - float(ref[i, t])) for i, top in enumerate(g.top_logprobs) for t, lp in top)
    print(f"max |top logprob over HTTP - in-process log_softmax| = {err:.3g}")
    assert err <= LP_BOUND
    for i, top in enumerate(g.top_logprobs):   # best first, and the largest values of the row
        vals = torch.tensor([lp for _, lp in top])
        assert torch.equal(vals, vals.sort(descending=True).values)
        assert torch.allclose(vals, torch.topk(ref[i], len(top)).values, atol=LP_BOUND, rtol=0)
    # negative control: one planted logprob error of 1e-3 exceeds the bound
    t, lp = g.top_logprobs[2][0]
    assert abs(lp + 1e-3 - float(ref[2, t])) > LP_BOUND


def test_concurrent_and_bench(engine, tiny_weights, prompt):
    prompts = [prompt[:17], prompt]
    gens = engine.concurrent(prompts, 8, "batched-16")
    for p, g in zip(prompts, gens):
        ref = generate(tiny_weights, torch.tensor(p), 8, "invariant", Schedule("batched", 16)).gen_ids
        assert bytes_equal(g.gen_ids, ref) and g.info["concurrent"] == 2
    b = bench_engine(engine, {"p": prompt}, 8, [], prompt)
    for r in (r for r in b["runs"] if r["config"] == "batched-16"):
        assert r["generated"] == 8 and r["ttft_s"] > 0 and r["prefill_tps"] > 0
        assert r["itl_p95_ms"] >= r["itl_p50_ms"] >= 0 and r["token_times"] == "engine"
    streams = b["streams"]["batched-16"]
    assert [s["streams"] for s in streams] == [1, 2] and all(s["equal_to_alone"] for s in streams)


def test_not_available_and_options(engine, prompt):
    with pytest.raises(NotAvailable, match="no configuration named 'drafted'"):
        engine.drafted(prompt, 4, "decode")
    with pytest.raises(NotAvailable, match="no configuration named 'resumed'"):
        engine.resumed(prompt[:5], prompt, 4, "decode")
    url = engine.endpoints["decode"].base_url   # a configuration named for drafted decoding makes it available
    named = OpenAIEngine.from_spec("", {"configurations": [{"name": "plain", "base_url": url},
                                                           {"name": "drafted", "base_url": url}]})
    assert "drafted" in named.capabilities and "prompt_cache" not in named.capabilities
    assert bytes_equal(named.drafted(prompt, 4, "plain").gen_ids, named.generate(prompt, 4, "plain").gen_ids)
    with pytest.raises(ValueError, match="no configuration 'nope'"):
        engine.generate(prompt, 4, "nope")
    with pytest.raises(ValueError, match=r"unknown options \['colour'\]"):
        OpenAIEngine.from_spec("http://127.0.0.1:1/v1", {"colour": "red"})
    with pytest.raises(ValueError, match="must contain \\{port\\}"):
        OpenAIEngine.from_spec("", {"configurations": [{"name": "a", "launch": "serve"}]})
    with pytest.raises(ValueError, match="oracle 'b'"):
        OpenAIEngine.from_spec("http://127.0.0.1:1/v1", {"oracle": "b"})
    eng = open_engine("openai:" + engine.endpoints["decode"].base_url, dtype="bfloat16")
    assert [c.name for c in eng.configurations()] == ["server"] and eng.encode("hi") == [256, 104, 105]
    assert eng.identity()["kind"] == "openai"


def test_temperature_refused_with_400(engine):
    ep = engine.endpoints["decode"]
    r = httpx.post(ep.base_url + "/completions", json={"prompt": [256, 1], "temperature": 0.7}, timeout=30)
    assert r.status_code == 400 and "0.7" in r.json()["error"]["message"]


def test_refused_connection():
    url = f"http://127.0.0.1:{free_port()}/v1"
    eng = OpenAIEngine.from_spec(url, {"model": "m"})
    with pytest.raises(EngineError, match="configuration 'server' at .*cannot connect"):
        eng.generate([1, 2, 3], 4, "server")


@pytest.fixture(scope="module")
def fakes():
    with ThreadServer(fake_app(sleep_s=3.0)) as s:
        yield s


@pytest.mark.parametrize("kind, words", [
    ("sleepy", "no answer .* within 0.5 s"),
    ("malformed", "malformed chunk \\(not JSON\\)"),
    ("status500", "HTTP 500 .*planted failure"),
    ("noend", "ended before data: \\[DONE\\]"),
    ("interrupted", "ended after 1 of 4 tokens with finish_reason None .*--interrupt_requests False"),
    ("abort", "finish_reason 'abort'"),
])
def test_failures_raise_engine_error(fakes, kind, words):
    eng = OpenAIEngine.from_spec(f"{fakes.url}/{kind}/v1", {"timeout_s": 0.5, "top_logprobs": 0})
    with pytest.raises(EngineError, match=f"openai engine, configuration 'server' at {fakes.url}/{kind}/v1: "
                                          f".*{words}"):
        eng.generate([1, 2, 3], 4, "server")


def test_text_only_server_compares_text_bytes(fakes):
    eng = OpenAIEngine.from_spec(f"{fakes.url}/textonly/v1", {"top_logprobs": 0})
    g = eng.generate([1, 2, 3], 4, "server")
    assert bytes_equal(g.gen_ids, torch.tensor(list("héllo".encode()), dtype=torch.int64))
    assert "no token ids" in g.info["gen_ids_are"] and g.info["text_hash"] == token_hash(g.gen_ids)
    assert g.info["lost"] == ["2 content chunks received for max_tokens 4 (no usage)"] and g.greedy is None


def test_server_dying_mid_stream(tmp_path):
    """The launched server's probe (one token) sees it die mid-stream: from_spec raises and stops it."""
    script = tmp_path / "dying.py"
    script.write_text(DYING_SERVER)
    with pytest.raises(EngineError, match="configuration 'dying' at http://127.0.0.1:.*(mid-stream|ended before)"):
        OpenAIEngine.from_spec("", {"configurations": [{"name": "dying", "launch": f"{sys.executable} {script} "
                                                        "{port}"}], "timeout_s": 10, "top_logprobs": 0})


def test_launch_failure_reports_output():
    cmd = f"{sys.executable} -c \"import sys; print('no model here'); sys.exit(3)\" {{port}}"
    with pytest.raises(EngineError, match="(?s)exited with status 3.*no model here"):
        OpenAIEngine.from_spec("", {"configurations": [{"name": "bad", "launch": cmd}], "launch_timeout_s": 30})
