"""``exactness serve`` over real HTTP (uvicorn in a thread, httpx): served tokens equal paths.generate's, streamed
equal non-streamed, logprobs and prompt logprobs (echo, vLLM's prompt_logprobs) equal log_softmax of the in-process
logit rows, chat (plain and tokenizer templates, chat logprobs), neutral knobs taken, EOS handling, refusals.
Batching under load: test_serve_batching.py."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
import torch

from exactness.cache import KVCache
from exactness.exact import bytes_equal, first_differing_row, token_hash
from exactness.kernels import get_set
from exactness.loop import decode_step
from exactness.paths import Schedule, generate, prefill
from exactness.prompts import plain_chat_text
from exactness.engines.serve import Served, build_parser, create_app
from exactness.tokenizer import ByteTokenizer
from http_servers import ThreadServer

SCHED = Schedule("batched", 16)
GEN = 12
LP_BOUND = 1e-5   # |served logprob - log_softmax of the in-process row|: both fp32 of the same row


@pytest.fixture(scope="module")
def server(tiny_weights):
    m = Served("tiny", tiny_weights, ByteTokenizer(), get_set("invariant"), SCHED, max_model_len=4096)
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


NEUTRAL = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "typical_p": 1, "tfs_z": 1, "repetition_penalty": 1,
           "repeat_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "mirostat": 0, "mirostat_mode": 0,
           "seed": 1234, "n": 1}


def test_neutral_knobs_are_accepted_and_greedy(server, tiny_weights, prompt):
    ref = generate(tiny_weights, prompt, 6, "invariant", SCHED).gen_ids
    for extra in (NEUTRAL, {**NEUTRAL, "top_k": 0, "seed": 7}):
        r = post(server, {"prompt": prompt.tolist(), "max_tokens": 6, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        assert bytes_equal(torch.tensor(r.json()["choices"][0]["token_ids"]), ref)


def _rows_ref(w, ids, sched):
    """In process: log_softmax of paths.prefill's fp32 prompt rows [P, V] -> (logprob of token i from row i-1
    [P-1], the rows [P-1, V])."""
    cache = KVCache(w.cfg, int(ids.numel()), 1, w.dtype, w.device)
    lp = torch.log_softmax(prefill(w, cache, ids, get_set("invariant"), sched).logits, dim=-1)[:-1]
    return lp[torch.arange(ids.numel() - 1), ids[1:]], lp


@pytest.mark.parametrize("sched", [SCHED, Schedule("decode")])
def test_prompt_logprobs_equal_the_served_prefill_rows(tiny_weights, prompt, sched):
    """Both wire formats (legacy echo + logprobs; vLLM's prompt_logprobs, streamed and not) carry log_softmax of
    the prefill's fp32 prompt rows, byte for byte; a value one ulp off is caught."""
    prompt = prompt[:24]
    N, P = 3, int(prompt.numel())
    want, lp = _rows_ref(tiny_weights, prompt, sched)
    gen = generate(tiny_weights, prompt, 4, "invariant", sched).gen_ids
    with ThreadServer(create_app(Served("tiny", tiny_weights, ByteTokenizer(), get_set("invariant"), sched))) as s:
        echo = post(s, {"prompt": prompt.tolist(), "max_tokens": 4, "ignore_eos": True, "echo": True,
                        "logprobs": N, "return_tokens_as_token_ids": True}).json()["choices"][0]
        only = post(s, {"prompt": prompt.tolist(), "max_tokens": 0, "echo": True, "logprobs": N}).json()
        body = {"prompt": prompt.tolist(), "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": N}
        vl = post(s, body).json()["choices"][0]
        _, chunks = streamed(s, body)
    e = echo["logprobs"]
    assert e["tokens"] == [f"token_id:{i}" for i in prompt.tolist() + gen.tolist()]
    assert e["token_logprobs"][0] is None and e["top_logprobs"][0] is None
    assert echo["text"].startswith(ByteTokenizer().decode(prompt.tolist())) and echo["token_ids"] == gen.tolist()
    got = torch.tensor(e["token_logprobs"][1:P], dtype=torch.float32)
    assert bytes_equal(got, want)
    assert all(sorted(t.values(), reverse=True) == torch.topk(lp[k], N).values.tolist()
               for k, t in enumerate(e["top_logprobs"][1:P]))
    o = only["choices"][0]
    assert o["token_ids"] == [] and o["text"] == ByteTokenizer().decode(prompt.tolist())
    assert o["logprobs"]["token_logprobs"][1:] == e["token_logprobs"][1:P] and only["usage"]["completion_tokens"] == 0
    first = next(c["choices"][0] for c in chunks if c["choices"])
    for pl in (vl["prompt_logprobs"], first["prompt_logprobs"]):
        assert len(pl) == P and pl[0] is None
        mine = [d[str(t)] for d, t in zip(pl[1:], prompt[1:].tolist())]
        assert bytes_equal(torch.tensor([x["logprob"] for x in mine], dtype=torch.float32), want)
        assert [x["rank"] for x in mine] == ((lp > want[:, None]).sum(1) + 1).tolist()
        for d, row in zip(pl[1:], lp):
            best = sorted((x["rank"], x["logprob"]) for x in d.values() if x["rank"] <= N)
            assert [v for _, v in best][:N] == torch.topk(row, N).values.tolist()
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:] if c["choices"])
    # negative control: one value one ulp off
    bad = got.clone()
    bad[7] = torch.nextafter(bad[7], torch.tensor(0.0))
    assert not bytes_equal(bad, want)


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


def test_concurrent_requests_equal_alone(server, tiny_weights, prompt):
    prompts = [prompt[:20], prompt[:33]]
    refs = [generate(tiny_weights, p, 8, "invariant", SCHED).gen_ids for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda p: streamed(server, {"prompt": p.tolist(), "max_tokens": 8,
                                                         "ignore_eos": True})[0], prompts))
    for got, ref in zip(outs, refs):
        assert bytes_equal(torch.tensor(got, dtype=torch.int64), ref)


def test_chat_plain_template_logprobs_and_models(server, tiny_weights):
    """Chat renders the byte tokenizer's messages with the plain template (named in the reply); tokens and
    logprobs equal the in-process run of that text, streamed and not; bytes are each token's own byte."""
    models = httpx.get(server.url + "/v1/models").json()
    assert [(d["id"], d["max_batch"]) for d in models["data"]] == [("tiny", 8)]
    msgs = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
    ids = ByteTokenizer().encode(plain_chat_text(msgs))
    run = generate(tiny_weights, ids, 6, "invariant", SCHED)
    ref = torch.log_softmax(run.gen_logits, dim=-1)                               # [G, V] fp32
    body = {"messages": msgs, "max_tokens": 6, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    r = post(server, body, "/v1/chat/completions").json()
    ch = r["choices"][0]
    assert r["object"] == "chat.completion" and r["exactness_template"] == "plain"
    assert ch["token_ids"] == run.gen_ids.tolist() and r["usage"]["prompt_tokens"] == ids.numel()
    content = ch["logprobs"]["content"]
    got = torch.tensor([e["logprob"] for e in content], dtype=torch.float32)
    assert bytes_equal(got, ref[torch.arange(6), run.gen_ids])                   # the fp32 values, exactly
    assert all(e["bytes"] == ([t] if t < 256 else []) and len(e["top_logprobs"]) == 3
               for e, t in zip(content, ch["token_ids"]))
    assert [e["logprob"] for e in content[0]["top_logprobs"]] == torch.topk(ref[0], 3).values.tolist()
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for d in deltas for t in d["token_ids"]] == ch["token_ids"]
    assert [e for d in deltas for e in d["logprobs"]["content"]] == content
    assert chunks[0]["object"] == "chat.completion.chunk"
    # negative control: a token whose logprob is off by one ulp is caught
    assert not bytes_equal(got, torch.nextafter(got, torch.full_like(got, 1.0)))


def test_chat_renders_the_tokenizer_template(tiny_weights, tmp_path):
    """A tokenizer with a chat template (a word-level one made here, saved and loaded as a checkpoint's) renders the
    messages; the reply names the template and its tokens equal the in-process run of the rendered ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from exactness.tokenizer import HFTokenizer
    words = ["<unk>", "<s>", "</s>", "hi", "there", "user", "assistant", ":", "|"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}"
                        "{% if add_generation_prompt %}assistant :{% endif %}")
    hf.save_pretrained(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    ids = tok.encode("user : hi there | assistant :")
    assert ids.tolist() == [5, 7, 3, 4, 8, 6, 7]
    ref = generate(tiny_weights, ids, 4, "invariant", SCHED).gen_ids
    with ThreadServer(create_app(Served("tiny", tiny_weights, tok, get_set("invariant"), SCHED))) as s:
        r = post(s, {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "ignore_eos": True},
                 "/v1/chat/completions").json()
    assert r["exactness_template"] == "chat_template" and r["usage"]["prompt_tokens"] == 7
    assert r["choices"][0]["token_ids"] == ref.tolist()


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
    ({"top_k": 40}, 400, ["top_k", "40", "-1 or 0"]),
    ({"repeat_penalty": 1.1}, 400, ["repeat_penalty", "1.1", "must be 1"]),
    ({"repetition_penalty": 1.05}, 400, ["repetition_penalty", "1.05"]),
    ({"presence_penalty": 0.5}, 400, ["presence_penalty", "0.5", "must be 0"]),
    ({"frequency_penalty": -1}, 400, ["frequency_penalty", "-1"]),
    ({"min_p": 0.05}, 400, ["min_p", "0.05"]),
    ({"typical_p": 0.9}, 400, ["typical_p", "0.9"]),
    ({"tfs_z": 0.5}, 400, ["tfs_z", "0.5"]),
    ({"mirostat_mode": 2}, 400, ["mirostat_mode", "2"]),
    ({"top_p": 0.9}, 400, ["top_p", "0.9"]),
    ({"seed": "7"}, 400, ["seed", "'7'"]),
    ({"echo": True, "stream": True}, 400, ["echo", "stream"]),
    ({"prompt_logprobs": -2}, 400, ["prompt_logprobs", "-2"]),
    ({"max_tokens": 5000}, 400, ["max_tokens", "5000", "[0, 4094]"]),
])
def test_refusals_name_the_value(server, body, status, words):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [256, 1], "max_tokens": 2, **body}, timeout=30)
    msg = r.json()["error"]["message"]
    assert r.status_code == status and all(w in msg for w in words), msg


def test_parser_options():
    a = build_parser().parse_args(["--preset", "tiny", "--kernels", "invariant", "--path", "deep", "--step", "16",
                                   "--deep-threshold", "8", "--port", "9", "--max-batch", "4",
                                   "--max-model-len", "512"])
    assert (a.path, a.step, a.deep_threshold, a.port, a.host) == ("deep", 16, 8, 9, "127.0.0.1")
    assert (a.max_batch, a.max_model_len) == (4, 512)
    assert build_parser().parse_args([]).max_batch == 8 and "continuous batching" in build_parser().format_help()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--path", "nope"])


def test_client_gone_mid_stream_stops_the_run(server, tiny_weights, prompt, monkeypatch):
    """A stream of 4000 tokens dropped after 2 chunks leaves the batch at the next step: once the scheduler is idle
    (a short request answered meanwhile), far fewer than the 4000 decode steps of the whole run were taken."""
    import exactness.loop as loop
    steps = []
    monkeypatch.setattr(loop, "decode_step", lambda *a, **k: steps.append(1) or decode_step(*a, **k))
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
    deadline = time.monotonic() + 60   # a run that was not stopped would still be active here, or past 4000 steps
    while (st := httpx.get(server.url + "/exactness/stats").json())["active"] or st["waiting"]:
        assert time.monotonic() < deadline and len(steps) < 1000, f"the dropped stream kept running: {st}"
        time.sleep(0.01)
    print(f"decode steps run for a 4000-token stream dropped after 2 chunks (+ those of the next request): "
          f"{len(steps)}")
    assert len(steps) < 1000


def test_top_logprobs_keyed_by_text_keep_the_best_of_colliding_texts(server):
    """Token texts collide (every lone byte >= 0x80 decodes to U+FFFD): the best logprob keeps the key, so a greedy
    reply's top-1 entry equals its chosen token's logprob."""
    from exactness.engines.serve_api import _keyed

    name = lambda i: "\ufffd" if i >= 128 else chr(i)   # noqa: E731
    assert _keyed(name, [(200, -1.0), (150, -2.0), (65, -3.0)]) == {"\ufffd": -1.0, "A": -3.0}
    assert _keyed(name, [(65, -0.5), (200, -1.0), (150, -2.0)]) == {"A": -0.5, "\ufffd": -1.0}
    lp = post(server, {"prompt": [1, 72], "max_tokens": 8, "logprobs": 5}).json()["choices"][0]["logprobs"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert max(top.values()) == chosen
