"""The repeat test (analysis/repeat.py): one prompt N times at several concurrency levels, distinct completions
counted by exact ids. Our reference engine and ``exactness serve`` with the invariant set give exactly one completion,
equal to in-process paths.generate; planted faults (a kernel that changes one row of a batched decode call, a fake
server whose every 4th reply differs at position 3) are counted as 2 distinct completions parting where planted;
failed requests are errors, never completions; load goes only to local servers."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from exactness.analysis import engines as E
from exactness.analysis import hashes as H
from exactness.analysis import engines_md
from exactness.analysis.repeat import distinct, parting, repeat_engine, repeat_errors, repeat_level
from exactness.analysis.repeat_md import repeat_block
from exactness.config import get_preset
from exactness.engines import open_engine
from exactness.engines.base import Configuration, NotAvailable
from exactness.run import Run
from exactness.engines.openai import OpenAIEngine
from exactness.engines.reference import ReferenceEngine
from exactness.paths import Schedule, generate
from exactness.params import ParamError
from exactness.params import HashesParams
from exactness.weights import synthetic_weights
from faults import row0_perturbed
from http_servers import ThreadServer

TOKENS = 8


@pytest.fixture(scope="module")
def w():
    return synthetic_weights(get_preset("tiny"))


@pytest.fixture(scope="module")
def ids(w):
    return ReferenceEngine(w).encode("def f(x):\n    return 2 * x + 1  # a line of code\n")[:24]


def test_distinct_counts_most_common_first_and_where_each_parts():
    comps = [(1, 2, 3), (1, 2, 4), (1, 2, 3), (9, 2, 3), (1, 2, 3), (1, 2, 4), (1, 2)]
    gs = distinct(comps)
    assert [g["count"] for g in gs] == [3, 2, 1, 1] and [g["ids"] for g in gs][:2] == [[1, 2, 3], [1, 2, 4]]
    assert [g["parts_at"] for g in gs] == [None, 2, 0, 2]        # (1, 2) is a prefix: parts at its length
    assert [g["first_request"] for g in gs] == [0, 1, 3, 6] and gs[0]["share"] == 3 / 7
    assert parting([5, 6], [5, 6]) is None and parting([5], [6]) == 0


def test_invariant_reference_engine_gives_one_completion_equal_to_generate(w, ids):
    eng = ReferenceEngine(w, None, "invariant", steps=[16], deep_threshold=8)
    res = repeat_engine(eng, "p", ids, 8, [1, 4], TOKENS)
    ref = generate(w, torch.tensor(ids), TOKENS, "invariant", Schedule("batched")).gen_ids.tolist()
    assert list(res["configs"]) == ["batched"]
    for lv in res["configs"]["batched"]:
        assert (lv["requests"], lv["failed"], lv["completions"], lv["distinct"]) == (8, 0, 8, 1), lv
        assert lv["groups"][0]["ids"] == ref and lv["first_parting"] is None and lv["compared_as"] == "token ids"
    assert res["configs"]["batched"][1]["largest_batch"] == 4      # 4 requests decoded in one forward


def test_planted_batch_fault_counts_two_completions_parting_where_planted(w, ids):
    """The argmax of row 0 of every multi-row decode call is moved to the next id: in each batch of 4 the first
    request leaves the others at generated position 1 (position 0 comes from its prefill, one row)."""
    fault = row0_perturbed("argmax", lambda t: (t + 1) % w.cfg.vocab_size, roles=("decode",))
    eng = ReferenceEngine(w, None, fault, steps=[16], deep_threshold=8)
    alone, batched = repeat_engine(eng, "p", ids, 8, [1, 4], TOKENS)["configs"]["batched"]
    assert alone["distinct"] == 1                                   # one row per call: the fault never fires
    assert (batched["distinct"], [g["count"] for g in batched["groups"]]) == (2, [6, 2])
    assert batched["groups"][1]["parts_at"] == batched["first_parting"] == 1
    assert batched["groups"][0]["ids"] == alone["groups"][0]["ids"]


class _NoBatching:
    """An in-process engine that runs requests alone only (as llama.cpp in process)."""
    kind, oracle = "nobatch", "a"

    def configurations(self):
        return [Configuration("a"), Configuration("b")]

    def generate(self, ids, gen, config):
        return Run(config, torch.arange(gen))

    def concurrent(self, prompts, gen, config):
        raise NotAvailable("requests run one at a time")


def test_an_engine_that_cannot_batch_gives_its_reason_not_a_count():
    res = repeat_engine(_NoBatching(), "p", [1, 2], 3, [1, 2], 4)
    (alone,) = res["configs"]["b"]                                 # the first configuration that is not the oracle
    assert alone["distinct"] == 1 and alone["concurrency"] == 1
    assert res["not_available"] == {"b": "concurrency 2: not available from this engine: requests run one at a time"}
    with pytest.raises(ValueError, match="no configuration 'c'; it has: a, b"):
        repeat_engine(_NoBatching(), "p", [1, 2], 3, [1], 4, ["c"])


def test_section_runs_the_repeat_test_alone_and_renders_it(w):
    sec = H.run_section(dict(engine=["reference"], device="cpu", dtype="bfloat16", prompts=["short", "code"],
                             prompt_max_tokens=24, steps=[16], gen_tokens=4, kernel_sets=["invariant"], preset="tiny",
                             deep_threshold=8, engine_repeat=4, engine_repeat_concurrency=[2],
                             engine_repeat_tokens=TOKENS, engine_repeat_prompt="code", engine_repeat_only=True))
    assert sec["rows"] == [] and sec["streams"] == {} and sec["errors"] == []
    res = sec["repeat"]["reference:invariant"]
    assert res["prompt"] == "code" and res["configs"]["batched"][0]["distinct"] == 1
    md = engines_md.render_md(sec)
    assert "The same request N times under load" in md
    assert "| reference:invariant | batched | code | 2 | 4 | 0 | 0 | 1 | 100.0% |" in " ".join(md.split())


def test_repeat_parameters_are_refused_up_front():
    base = dict(engine=["reference"], prompts=["short"], engine_repeat=4, device="cpu", dtype="bfloat16", steps=[16],
                gen_tokens=4)
    with pytest.raises(ParamError, match="10.1.2.3.*only to servers on this machine"):
        HashesParams.from_dict({**base, "engine": ["openai:http://10.1.2.3:8000/v1"]})
    HashesParams.from_dict({**base, "engine": ["openai:http://localhost:8000/v1"]})   # local: accepted
    for key, bad, words in (("engine_repeat_concurrency", [0], "engine_repeat_concurrency"),
                            ("engine_repeat_concurrency", [], "non-empty list"),
                            ("engine_repeat", -1, "engine_repeat must be an int >= 0"),
                            ("engine_repeat_prompt", "docs", "not a prompt of this run"),
                            ("engine_repeat_tokens", 0, "engine_repeat_tokens")):
        with pytest.raises(ParamError, match=words):
            HashesParams.from_dict({**base, key: bad})
    with pytest.raises(ParamError, match="engine_repeat_only=true needs engine_repeat"):
        HashesParams.from_dict({**base, "engine_repeat": 0, "engine_repeat_only": True})


# ------------------------------------------------------------------------------------------------- over HTTP

def repeat_app(odd_every: int, fail_every: int = 0, text: bool = False, penalty_every: int = 0) -> FastAPI:
    """A fake server streaming 4 token ids [10, 11, 12, 13] per request; every ``odd_every``-th request (in
    arrival order) sends 99 at position 3, every ``fail_every``-th answers HTTP 500; ``text`` streams text only;
    with logprobs asked, every ``penalty_every``-th reply's last token is not its row's top-1 (as a server applying
    a repeat penalty)."""
    app, lock, seen = FastAPI(), threading.Lock(), [0]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-repeat", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        with lock:
            seen[0] += 1
            k = seen[0]
        if fail_every and k % fail_every == 0:
            return JSONResponse({"error": {"message": f"planted failure of request {k}"}}, status_code=500)
        toks = [10, 11, 12, 99 if k % odd_every == 0 else 13]
        off = bool(penalty_every) and k % penalty_every == 0
        lps = [_logprobs(t, off and i == 3) if body.get("logprobs") else None for i, t in enumerate(toks)]
        parts = [_chunk(chr(97 + t % 26), None if text else [t], "length" if i == 3 else None, lps[i])
                 for i, t in enumerate(toks)] + ["data: [DONE]\n\n"]

        async def gen():
            for p in parts:
                yield p
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _logprobs(token: int, below_top: bool) -> dict:
    """One token's legacy logprobs: the chosen token at -0.1, or at -2.0 under another token at -0.1."""
    lp = -2.0 if below_top else -0.1
    top = {f"token_id:{token}": lp} | ({"token_id:7": -0.1} if below_top else {"token_id:7": -3.0})
    return {"tokens": [f"token_id:{token}"], "token_logprobs": [lp], "top_logprobs": [top]}


def _chunk(text: str, ids: list | None, finish: str | None, logprobs: dict | None = None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish} | ({"token_ids": ids} if ids is not None else {})
    choice |= {"logprobs": logprobs} if logprobs else {}
    return "data: " + json.dumps({"id": "x", "object": "text_completion", "choices": [choice]}) + "\n\n"


def _fake_engine(url: str) -> OpenAIEngine:
    return OpenAIEngine.from_spec(url + "/v1", {"top_logprobs": 0, "timeout_s": 20, "prompt_logprobs": "off"})


def test_fake_server_fault_and_failures_are_counted_not_merged():
    with ThreadServer(repeat_app(odd_every=4, fail_every=5)) as s:
        lv = repeat_level(_fake_engine(s.url), [1, 2, 3], 12, 4, 4, "server")
    assert (lv["requests"], lv["failed"], lv["completions"]) == (12, 2, 10)   # requests 5 and 10 failed
    assert [g["count"] for g in lv["groups"]] == [7, 3] and lv["first_parting"] == 3
    assert lv["groups"][1]["ids"] == [10, 11, 12, 99] and "planted failure" in lv["errors"][0]
    errs = repeat_errors("fake", {"configs": {"server": [lv]}})
    assert len(errs) == 1 and "2 of 12 requests failed" in errs[0]["error"] and errs[0]["engine"] == "fake"


def test_replies_found_not_greedy_are_counted_apart():
    """Logprobs asked: every 3rd reply's chosen last token sits below another (a penalty): those are not greedy and
    never completions; the greedy ones are checked and counted."""
    with ThreadServer(repeat_app(odd_every=100, penalty_every=3)) as s:
        eng = OpenAIEngine.from_spec(s.url + "/v1", {"top_logprobs": 2, "timeout_s": 20, "prompt_logprobs": "off"})
        lv = repeat_level(eng, [1, 2, 3], 9, 3, 4, "server")
    assert (lv["failed"], lv["not_greedy"], lv["completions"], lv["greedy_checked"], lv["distinct"]) == (0, 3, 6, 6, 1)


def test_text_only_server_is_compared_as_bytes_and_marked():
    with ThreadServer(repeat_app(odd_every=3, text=True)) as s:
        lv = repeat_level(_fake_engine(s.url), [1, 2, 3], 6, 3, 4, "server")
    assert lv["compared_as"].startswith("utf-8 bytes") and lv["distinct"] == 2 and lv["first_parting"] == 3
    block = repeat_block({"fake": {"prompt": "p|q\nr", "configs": {"server": [lv]}}})
    assert "utf-8 bytes" in block and "| p\\|q r |" in " ".join(block.split())   # the table stays intact


def test_exactness_serve_invariant_gives_one_completion_under_load(w, ids, tmp_path):
    """``exactness serve --max-batch 8`` with each kernel set, launched by the openai adapter from a YAML engine
    file; 16 requests at concurrency 8: the invariant server's one completion equals paths.generate, and it did
    batch (its largest decode batch > 1); the fast set's count is reported, not asserted."""
    serve = "{python} -m exactness serve --preset tiny --path batched --max-batch 8 --port {port}"
    spec = tmp_path / "serve.yaml"
    spec.write_text(f"kind: openai\noracle: invariant\ntimeout_s: 60\nconfigurations:\n"
                    f"  - {{name: invariant, launch: '{serve} --kernels invariant'}}\n"
                    f"  - {{name: fast, launch: '{serve} --kernels fast'}}\n")
    eng = open_engine(str(spec))
    try:
        res = repeat_engine(eng, "p", ids, 16, [8], TOKENS)
        stats = {n: httpx.get(e.base_url.removesuffix("/v1") + "/exactness/stats", timeout=10).json()
                 for n, e in eng.endpoints.items()}
    finally:
        eng.close()
    ref = generate(w, torch.tensor(ids), TOKENS, "invariant", Schedule("batched")).gen_ids.tolist()
    (inv,), (fast,) = res["configs"]["invariant"], res["configs"]["fast"]
    assert (inv["requests"], inv["failed"], inv["distinct"]) == (16, 0, 1) and inv["groups"][0]["ids"] == ref
    assert stats["invariant"]["max_rows"] > 1, stats
    assert fast["failed"] == 0 and fast["distinct"] >= 1
    print(f"exactness serve, 16 requests at concurrency 8: invariant {inv['distinct']} distinct, fast "
          f"{fast['distinct']} distinct (counts {[g['count'] for g in fast['groups']]}); largest decode batch "
          f"invariant {stats['invariant']['max_rows']}, fast {stats['fast']['max_rows']}")
