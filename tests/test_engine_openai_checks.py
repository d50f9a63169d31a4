"""What the ``openai`` engine checks in a server's replies, against fake servers (http_servers.fake_app) on
127.0.0.1: the neutral sampling knobs sent (and overridden), a chosen token below its row's top-1 caught as not
greedy, lossy text named, prompt logprobs compared row by row, chat-only servers, and probes that fail in seconds
with one line; each check with the planted fault that makes it fail."""
from __future__ import annotations

import time

import pytest

from exactness.analysis.engines import compare
from exactness.analysis.engines_md import verdict_md
from exactness.engines.base import Chat, EngineError
from exactness.engines.openai import OpenAIEngine, probe_urls
from exactness.engines.openai_checks import NEUTRAL_SAMPLING, greedy_check
from http_servers import ThreadServer, fake_app, free_port


@pytest.fixture(scope="module")
def fakes():
    with ThreadServer(fake_app(sleep_s=3.0)) as s:
        yield s


def _engine(url, **options):
    return OpenAIEngine.from_spec(url, {"timeout_s": 5, **options})


def test_neutral_knobs_sent_overridden_and_recorded(fakes):
    eng = _engine(f"{fakes.url}/plp/v1", model="m", sampling={"top_k": 0, "seed": None, "tfs_z": None})
    url, body = eng._body(eng.endpoints["server"], [1, 2], 4, False, True)
    assert url.endswith("/v1/completions") and body["max_tokens"] == 4 and body["ignore_eos"] is True
    want = {**NEUTRAL_SAMPLING, "top_k": 0}
    del want["seed"], want["tfs_z"]
    assert {k: body[k] for k in want} == want and "seed" not in body and "tfs_z" not in body
    assert {"temperature": 0, "top_p": 1, "min_p": 0, "repetition_penalty": 1.0, "repeat_penalty": 1.0,
            "presence_penalty": 0, "frequency_penalty": 0, "mirostat_mode": 0}.items() <= body.items()
    assert eng.identity()["configurations"]["server"]["sampling"] == want
    with pytest.raises(ValueError, match="sampling must be a mapping"):
        _engine(f"{fakes.url}/plp/v1", sampling=[1])


def test_a_token_below_the_top1_is_not_greedy(fakes):
    eng = _engine(f"{fakes.url}/notgreedy/v1", prompt_logprobs="off")
    ok, bad = eng.generate([1, 2], 1, "server"), eng.generate([1, 2], 3, "server")
    assert ok.greedy is True and ok.gen_ids.tolist() == [97]
    assert bad.greedy is False and bad.gen_ids.tolist() == [97, 99, 97]
    assert bad.info["greedy_check"] == {"position": 1, "chosen_logprob": -2.0, "top1_logprob": -0.25,
                                        "top1_token": "token_id:98"}
    row = compare(bad, bad)   # equal tokens, but never compared as greedy
    assert row["verdict"].startswith("not greedy: this run chose a token below the top-1 at position 1")
    assert row["equals_oracle"] is None and row["greedy"] is False
    ref = compare(ok, bad)    # the reference not greedy: the run is not judged either
    assert ref["verdict"].startswith("not greedy: its reference server") and ref["equals_oracle"] is not True
    # a tie at equal logprob is top-1; a row keyed by texts that several tokens share is not checked
    assert greedy_check([-1.0], [([(5, -1.0), (6, -1.0)], False)], 2)[0] is True
    assert greedy_check([-1.0], [([("", -1.0), ("a", -2.0)], True)], 2)[0] is None
    assert greedy_check([-1.5], [([("", -1.0), ("a", -1.5)], True)], 2)[0] is None   # may be misaligned
    assert greedy_check([-1.5], [([("b", -1.0), ("a", -1.5)], True)], 2)[0] is False
    assert greedy_check([-1.0, -1.0], [([(5, -1.0)], False)] * 2, 1, tokens=3) == \
        (None, {"not_checked": "2 logprob entries for 3 generated tokens"})
    assert eng.generate([1, 2], 3, "server").greedy is False   # no logprobs asked: not checked
    assert _engine(f"{fakes.url}/notgreedy/v1", top_logprobs=0).generate([1], 3, "server").greedy is None


def test_lossy_text_is_named_and_counted_apart(fakes):
    eng = _engine(f"{fakes.url}/lossy/v1", top_logprobs=0, prompt_logprobs="off")
    g = eng.generate([1, 2], 4, "server")
    assert g.gen_ids.tolist() == list("h\ufffdi".encode()) and g.greedy is None
    assert g.info["lost"] == ["the text holds 1 U+FFFD (replaced invalid bytes)",
                              "usage.completion_tokens 7 != max_tokens 4",
                              "usage.completion_tokens 7 != 2 content chunks received"]
    row = compare(g, g)
    assert row["verdict"].startswith("equal as text, lossy: the text holds 1 U+FFFD") and row["equals_oracle"] is None
    exact = compare(eng.generate([1, 2], 4, "server"), g)
    exact_ids = {**exact, "verdict": "equal"}
    sec = {"engines": [{"spec": "e", "oracle": "o"}],
           "rows": [{**r, "engine": "e", "config": c, "oracle": "o"} for r, c in ((row, "a"), (exact_ids, "b"))]}
    line = verdict_md(sec)
    assert "1/2 runs equal their oracle" in line and "1/2 equal as text only (lossy)" in line, line
    # negative control: a lossless text reply has nothing in info["lost"]
    assert "lost" not in _engine(f"{fakes.url}/chatonly/v1", api="chat").generate(Chat((("user", "ok"),)), 2,
                                                                               "server").info


def test_prompt_logprobs_compared_row_by_row(fakes):
    eng = OpenAIEngine.from_spec("", {"configurations": [{"name": "a", "base_url": f"{fakes.url}/plp/v1"},
                                                         {"name": "b", "base_url": f"{fakes.url}/plpbad/v1"}],
                                      "top_logprobs": 2, "timeout_s": 5})
    prompt = [256, 97, 98, 99]
    a, b = eng.generate(prompt, 1, "a"), eng.generate(prompt, 1, "b")
    assert eng.generate(prompt, 1, "a").prompt_logprobs is None   # asked once per configuration and prompt
    a2 = _engine(f"{fakes.url}/plp/v1", top_logprobs=2).generate(prompt, 1, "server")
    assert "prompt_logprobs" in eng.capabilities and a.info["prompt_logprobs_via"] == "vllm"
    assert a.prompt_logprob_ids.tolist() == [[97, 5, 97], [98, 98, -1], [99, 7, -1]]
    assert a.prompt_logprobs[:, 0].tolist() == [-1.5, -0.25, -2.0] and a.prompt_logprobs[1, 2] == -float("inf")
    same, diff = compare(a2, a), compare(b, a)
    assert same["prompt_logprobs_equal"] is True and same["verdict"] == \
        "equal (not exposed: prompt logits, generated logits, KV)"
    assert diff["prompt_logprobs_equal"] is False and diff["first_differing_prompt_logprob_row"] == 1
    assert diff["prompt_logprob_rows_differing"] == 1 and diff["verdict"] == "differs: prompt logprobs"
    assert eng.configurations()[0].settings["prompt_logprobs"] == "vllm"
    with pytest.raises(EngineError, match="prompt_logprobs echo"):   # a format asked by name must answer
        _engine(f"{fakes.url}/plp/v1", prompt_logprobs="echo").generate(prompt, 1, "server")
    off = _engine(f"{fakes.url}/notgreedy/v1")   # auto: neither format answered -> off, with why
    assert off.generate(prompt, 1, "server").prompt_logprobs is None
    assert "prompt_logprobs" not in off.capabilities
    assert off.configurations()[0].settings["prompt_logprobs"].startswith("off (vllm: ")


@pytest.mark.parametrize("stream", [True, False])
def test_chat_only_server(fakes, stream):
    eng = _engine(f"{fakes.url}/chatonly/v1", api="auto", stream=stream)
    ids = eng.encode("hey")
    g = eng.generate(ids, 5, "server")   # a text prompt: sent as one user message, the text as given
    assert eng.endpoints["server"].api == "chat" and g.info["api"] == "chat"
    assert bytes(g.gen_ids.tolist()) == b"heyhe" and g.greedy is True
    assert g.info["gen_ids_are"].startswith("bytes of the generated tokens") and "lost" not in g.info
    c = eng.generate(Chat((("system", "s"), ("user", "xy"))), 3, "server")
    assert bytes(c.gen_ids.tolist()) == b"xyx"
    with pytest.raises(EngineError, match="chat/completions only .*an ids prompt \\(2 ids\\) cannot be sent"):
        eng.generate([1, 2], 3, "server")
    with pytest.raises(EngineError, match="a text prompt cut to 2 tokens \\(prompt_max_tokens\\) has no text"):
        eng.generate(ids[:2], 3, "server")
    with pytest.raises(EngineError, match="HTTP 404"):   # api completions is not switched
        _engine(f"{fakes.url}/chatonly/v1").generate(ids, 2, "server")


@pytest.mark.parametrize("kind, words", [
    ("refused", "GET http://127.0.0.1:\\d+/v1/models: connection refused"),
    ("status500", "HTTP 500 from .*/status500/v1/completions: .*planted failure"),
    ("garbage", "GET .*/garbage/v1/models did not answer a model list .*not json"),
    ("malformed", "malformed chunk \\(not JSON\\)"),
    ("noend", "ended before data: \\[DONE\\]"),
    ("sleepy", "no answer from .* within"),
])
def test_probes_fail_in_seconds_with_one_line(fakes, kind, words):
    url = f"http://127.0.0.1:{free_port()}/v1" if kind == "refused" else f"{fakes.url}/{kind}/v1"
    t0 = time.monotonic()
    with pytest.raises(EngineError) as e:
        probe_urls("", {"configurations": [{"name": "c1", "base_url": url}], "timeout_s": 2})
    msg = str(e.value)
    assert time.monotonic() - t0 < 15 and "\n" not in msg
    assert msg.startswith(f"openai engine, configuration 'c1' at {url}: "), msg
    assert __import__("re").search(words, msg), msg


def test_probe_passes_a_working_server_and_resolves_formats(fakes):
    assert probe_urls(f"{fakes.url}/plp/v1", {}) == ["server"]
    eng = _engine(f"{fakes.url}/plp/v1")
    assert "prompt_logprobs" not in eng.capabilities   # not yet asked
    eng.probe()
    assert "prompt_logprobs" in eng.capabilities and eng.endpoints["server"].api == "completions"


def test_refused_knob_is_named(fakes):
    """A server that refuses a knob (llama-cpp-python: top_k must be >= 0) fails the probe naming the knob."""
    from exactness.engines.openai_checks import refused_knob
    hint = refused_knob("{'loc': ('body', 'top_k'), 'msg': 'Input should be greater than or equal to 0'}",
                        NEUTRAL_SAMPLING)
    assert "sampling knob top_k=-1" in hint and "`sampling: {top_k: <a value it takes>}`" in hint
    assert refused_knob("model not found", NEUTRAL_SAMPLING) == ""


def test_launch_command_python_placeholder(tmp_path):
    import sys
    from exactness.engines.openai_http import launch_line
    assert launch_line("{python} -m x --port {port}", 5).split() == [sys.executable, "-m", "x", "--port", "5"]
    with pytest.raises(ValueError, match="may use \\{port\\} and \\{python\\} only"):
        OpenAIEngine.from_spec("", {"configurations": [{"name": "a", "launch": "{py} --port {port}"}]})
