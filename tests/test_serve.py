"""``exactness serve`` over real HTTP (uvicorn in a thread, httpx): served tokens equal paths.generate's, streamed
equal non-streamed, logprobs equal log_softmax of the in-process logit rows, EOS handling, refusals."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
import torch

from exactness.exact import bytes_equal, first_differing_row, token_hash
from exactness.kernels import get_set
from exactness.paths import Schedule, decode_step, generate
from exactness.engines.serve import Served, build_parser, create_app
from exactness.tokenizer import ByteTokenizer
from http_servers import ThreadServer

SCHED = Schedule("batched", 16)
GEN = 12
LP_BOUND = 1e-5   # |served logprob - log_softmax of the in-process row|: both fp32 of the same row


@pytest.fixture(scope="module")
def server(tiny_weights):
    m = Served("tiny", tiny_weights, ByteTokenizer(), get_set("invariant"), SCHED)
    with ThreadServer(create_app(m)) as s:
        yield s


@pytest.fixture(scope="module")
def prompt(code_prompt):
    return code_prompt.ids[:40]


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"temperature": 0, **body}, timeout=60)


def streamed(server, body: dict) -> tuple[list[int], list[dict]]:
    """(token ids, chunks) of a streamed completion; asserts it ends with data: [DONE]."""
    ids, chunks, done = [], [], False
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert not done, "data after [DONE]"
                if line == "data: [DONE]":
                    done = True
                    continue
                c = json.loads(line[6:])
                chunks.append(c)
                for ch in c["choices"]:
                    ids += ch["token_ids"]
    assert done
    return ids, chunks


def test_served_tokens_equal_in_process(server, tiny_weights, prompt):
    ref = generate(tiny_weights, prompt, GEN, "invariant", SCHED).gen_ids
    body = {"prompt": prompt.tolist(), "max_tokens": GEN, "ignore_eos": True}
    got = torch.tensor(post(server, body).json()["choices"][0]["token_ids"], dtype=torch.int64)
    s_ids, chunks = streamed(server, body)
    got_s = torch.tensor(s_ids, dtype=torch.int64)
    for g in (got, got_s):
        assert token_hash(g) == token_hash(ref) and bytes_equal(g, ref)
    assert len(chunks) == GEN + 1 and chunks[-1]["usage"]["completion_tokens"] == GEN   # one token per chunk
    # negative control: one planted token is caught by both checks, at its index
    bad = ref.clone()
    bad[5] += 1
    assert token_hash(got) != token_hash(bad) and not bytes_equal(got, bad)
    assert first_differing_row(got, bad) == 5


@pytest.mark.parametrize("kernels, sched", [("fast", Schedule("decode")), ("invariant", Schedule("deep", 16, 8)),
                                            ("fast", Schedule("batched", None))])
def test_other_schedules_equal_in_process(tiny_weights, prompt, kernels, sched):
    ref = generate(tiny_weights, prompt, 8, kernels, sched)
    with ThreadServer(create_app(Served("tiny", tiny_weights, ByteTokenizer(), get_set(kernels), sched))) as s:
        r = post(s, {"prompt": prompt.tolist(), "max_tokens": 8, "ignore_eos": True}).json()
    assert bytes_equal(torch.tensor(r["choices"][0]["token_ids"], dtype=torch.int64), ref.gen_ids)
    assert r["exactness_served"] == ref.served          # the same plans served the prefill
    assert r["system_fingerprint"].startswith(f"exactness:{kernels}:{sched.path}:")


def test_string_prompt_uses_the_byte_tokenizer(server, tiny_weights):
    ids = ByteTokenizer().encode("def f(x):")
    ref = generate(tiny_weights, ids, 8, "invariant", SCHED).gen_ids
    r = post(server, {"prompt": "def f(x):", "max_tokens": 8, "ignore_eos": True}).json()
    assert bytes_equal(torch.tensor(r["choices"][0]["token_ids"]), ref)
    assert r["usage"]["prompt_tokens"] == ids.numel()
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "def f(x):"}).json()["tokens"]
    assert tok == ids.tolist()


def test_logprobs_match_in_process_rows(server, tiny_weights, prompt):
    N = 4
    run = generate(tiny_weights, prompt, GEN, "invariant", SCHED)
    ref = torch.log_softmax(run.gen_logits.float(), dim=-1)                       # [G, V] fp32
    body = {"prompt": prompt.tolist(), "max_tokens": GEN, "ignore_eos": True, "logprobs": N,
            "return_tokens_as_token_ids": True}
    lp = post(server, body).json()["choices"][0]["logprobs"]
    err, where = 0.0, None
    for g, (tok, tlp, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        assert tok == f"token_id:{int(run.gen_ids[g])}" and len(top) == N
        pairs = [(int(k.split(":")[1]), v) for k, v in top.items()] + [(int(run.gen_ids[g]), tlp)]
        for i, v in pairs:
            e = abs(v - float(ref[g, i]))
            err, where = (e, (g, i)) if e > err else (err, where)
        # the served top-N are the N largest of the row (values compared, so ties need not order alike)
        want = torch.topk(ref[g], N).values
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), want, atol=LP_BOUND, rtol=0)
    print(f"max |served logprob - in-process log_softmax| = {err:.3g} at (token, id) {where}")
    assert err <= LP_BOUND
    # negative control: a planted error of 1e-3 in one logprob exceeds the bound
    assert abs(lp["token_logprobs"][3] + 1e-3 - float(ref[3, run.gen_ids[3]])) > LP_BOUND


def test_eos_stops_unless_ignored(server, tiny_weights, prompt):
    ref = generate(tiny_weights, prompt, GEN, "invariant", SCHED).gen_ids
    eos = int(ref[4])          # a model whose EOS is the 5th generated token (EOS does not enter the forward)
    first = int((ref == eos).nonzero()[0])
    w = replace(tiny_weights, cfg=tiny_weights.cfg.replace(eos_id=eos))
    with ThreadServer(create_app(Served("tiny", w, ByteTokenizer(), get_set("invariant"), SCHED))) as s:
        body = {"prompt": prompt.tolist(), "max_tokens": GEN}
        stop = post(s, body).json()["choices"][0]
        full = post(s, {**body, "ignore_eos": True}).json()["choices"][0]
    assert stop["finish_reason"] == "stop" and stop["token_ids"] == ref[:first + 1].tolist()
    assert full["finish_reason"] == "length" and full["token_ids"] == ref.tolist()


def test_concurrent_requests_are_served_one_at_a_time_and_equal(server, tiny_weights, prompt):
    prompts = [prompt[:20], prompt[:33]]
    refs = [generate(tiny_weights, p, 8, "invariant", SCHED).gen_ids for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: streamed(server, {"prompt": p.tolist(), "max_tokens": 8,
                                                         "ignore_eos": True})[0], prompts))
    for got, ref in zip(outs, refs):
        assert bytes_equal(torch.tensor(got, dtype=torch.int64), ref)


def test_chat_and_models(server, tiny_weights):
    models = httpx.get(server.url + "/v1/models").json()
    assert [d["id"] for d in models["data"]] == ["tiny"]
    r = post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
             "/v1/chat/completions").json()
    ref = generate(tiny_weights, ByteTokenizer().encode("hi"), 4, "invariant", SCHED).gen_ids
    assert r["object"] == "chat.completion" and r["choices"][0]["token_ids"] == ref.tolist()


@pytest.mark.parametrize("body, status, words", [
    ({"temperature": 0.7}, 400, ["temperature", "0.7"]),
    ({"n": 2}, 400, ["n must be 1", "2"]),
    ({"prompt": [1, 999]}, 400, ["[0, 258)", "999"]),
    ({"prompt": []}, 400, ["empty"]),
    ({"prompt": [[1, 2], [3]]}, 400, ["one prompt per request"]),
    ({"max_tokens": 10 ** 9}, 400, ["max_tokens", "1000000000"]),
    ({"logprobs": -1}, 400, ["logprobs", "-1"]),
    ({"model": "other"}, 404, ["'other'", "'tiny'"]),
    ({"stop": ["\n"]}, 400, ["stop"]),
])
def test_refusals_name_the_value(server, body, status, words):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [256, 1], "max_tokens": 2, **body}, timeout=30)
    msg = r.json()["error"]["message"]
    assert r.status_code == status and all(w in msg for w in words), msg


def test_parser_options():
    a = build_parser().parse_args(["--preset", "tiny", "--kernels", "invariant", "--path", "deep", "--step", "16",
                                   "--deep-threshold", "8", "--port", "9"])
    assert (a.path, a.step, a.deep_threshold, a.port, a.host) == ("deep", 16, 8, 9, "127.0.0.1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--path", "nope"])


def test_client_gone_mid_stream_stops_the_run(server, tiny_weights, prompt, monkeypatch):
    """A stream of 4000 tokens dropped after 2 chunks stops at the next token: the short request queued behind it on
    the one worker is answered after far fewer than the 4000 decode steps the whole run would take."""
    import exactness.engines.serve as serve
    steps = []
    monkeypatch.setattr(serve, "decode_step", lambda *a, **k: steps.append(1) or decode_step(*a, **k))
    long = {"prompt": prompt.tolist(), "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
    got = []
    with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60) as r:
        for line in r.iter_lines():
            got += [line] if line.startswith("data: ") else []
            if len(got) == 2:
                break
    ref = generate(tiny_weights, prompt, 4, "invariant", SCHED).gen_ids
    r = post(server, {"prompt": prompt.tolist(), "max_tokens": 4, "ignore_eos": True}).json()
    assert r["choices"][0]["token_ids"] == ref.tolist()
    print(f"decode steps run for a 4000-token stream dropped after 2 chunks (+3 of the next request): {len(steps)}")
    assert len(steps) < 1000
