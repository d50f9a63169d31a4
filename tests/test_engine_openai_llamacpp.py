"""The ``openai`` engine against llama-cpp-python's own server (``{python} -m llama_cpp.server``, launched by the
adapter) on the tiny GGUF, over real HTTP on 127.0.0.1: greedy checked, not assumed, and prompt logprobs through the
legacy ``echo`` + ``logprobs``.

The server's default repeat_penalty is 1.1. A configuration that drops the neutral knob (``sampling:
{repeat_penalty: null}``) gets the penalty, and on a repetitive prompt where the penalty changes a token its row is
"not greedy" (the chosen token's logprob below the top-1's); with the neutral knobs the row is greedy and its bytes
equal llama-cpp-python's in-process greedy tokens. Which prompts the penalty flips depends on the CPU's arithmetic,
so the prompt is picked at run time among repetitive ASCII prompts by running the penalty in process first.

The server returns text only: top_logprobs 1 keeps each row's top list free of texts that several byte tokens share
(an invalid UTF-8 byte comes back as ""), so every greedy row can be checked; the prompt is one whose tokens are all
ASCII, so the text is lossless.
"""
from __future__ import annotations

import pytest
import torch

from exactness.analysis.engines import compare
from exactness.engines import gguf_export
from exactness.engines.openai import OpenAIEngine
from exactness.engines.tiny import save_tiny_qwen3_moe

GEN = 8
CANDIDATES = [u * k for u in ("hello ", ".", "a", "_", "M", "cat ", "xy", "abc", "01") for k in (8, 16, 32)]
SERVER = "{python} -m llama_cpp.server --model %s --port {port} --n_threads 1 --n_ctx 512"
BOUND = 1e-5   # fp32 log-softmax of the same logits, numpy on the server vs torch here: a few ulps at |x| ~ 5


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install "
                               "'llama-cpp-python[server]'")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, llama_cpp):
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server extra is not installed")
    root = tmp_path_factory.mktemp("openai-llamacpp")
    return gguf_export.export_gguf(save_tiny_qwen3_moe(root / "tiny"), root / "tiny.gguf")


@pytest.fixture(scope="module")
def picked(gguf, llama_cpp):
    """(text, ids, in-process greedy tokens, first position the repeat penalty 1.1 changes) of the first candidate
    whose greedy tokens and penalized tokens up to that position are ASCII."""
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_threads=1, logits_all=True, verbose=False)

    def run(ids, penalty):
        it = llm.generate(ids, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=penalty, reset=True)
        return [t for t, _ in zip(it, range(GEN))]
    for text in CANDIDATES:
        ids = llm.tokenize(text.encode(), add_bos=True)
        plain, pen = run(ids, 1.0), run(ids, 1.1)
        k = next((i for i, (a, b) in enumerate(zip(plain, pen)) if a != b), None)
        if k is not None and all(t < 128 for t in plain + pen[:k + 1]):
            llm.reset()
            llm.eval(ids)
            scores = torch.from_numpy(llm.scores[:len(ids)].copy())
            return text, ids, plain, k, scores
    pytest.fail(f"none of {len(CANDIDATES)} repetitive prompts has a token the repeat penalty changes with ASCII "
                "tokens up to it on this CPU")


@pytest.fixture(scope="module")
def engine(gguf):
    cmd = SERVER % gguf
    eng = OpenAIEngine.from_spec("", {"configurations": [
        {"name": "neutral", "launch": cmd},
        {"name": "penalized", "launch": cmd, "sampling": {"repeat_penalty": None}}],
        "sampling": {"top_k": 0},   # this server takes top_k >= 0 only (0: off)
        "token_ids": False, "top_logprobs": 1, "timeout_s": 60, "launch_timeout_s": 120})
    yield eng
    eng.close()


def test_repeat_penalty_is_caught_as_not_greedy(engine, picked):
    text, ids, plain, k, _ = picked
    assert engine.encode(text) == ids
    neutral, pen = engine.generate(ids, GEN, "neutral"), engine.generate(ids, GEN, "penalized")
    print(f"prompt {text!r}: in-process greedy {plain}, the penalty changes position {k}; server penalized "
          f"{pen.gen_ids.tolist()}, {pen.info['greedy_check']}")
    assert neutral.greedy is True and "lost" not in neutral.info, neutral.info
    assert neutral.gen_ids.tolist() == plain   # the text's bytes are the byte tokens' ids
    assert pen.greedy is False and pen.info["greedy_check"]["position"] == k
    assert pen.info["greedy_check"]["chosen_logprob"] < pen.info["greedy_check"]["top1_logprob"]
    row = compare(pen, neutral)
    assert row["verdict"].startswith(f"not greedy: this run chose a token below the top-1 at position {k}")
    assert row["equals_oracle"] is not True
    assert compare(neutral, neutral)["verdict"].startswith("equal")
    assert "repeat_penalty" not in engine.configurations()[1].settings["sampling"]
    assert engine.configurations()[0].settings["sampling"]["repeat_penalty"] == 1.0


def test_prompt_logprobs_through_echo(engine, picked):
    """llama-cpp-python answers echo + logprobs (vLLM's prompt_logprobs it ignores): the prompt tokens after BOS
    (which it does not list) and after the first (no logprob), each row's logprob = log_softmax of the in-process
    logit row before it; both servers give byte-equal rows (sampling knobs do not touch them), and one moved ulp
    is named with its row."""
    _, ids, _, _, scores = picked
    ids = ids[:-1]   # a prompt not run before on this engine: its first run per configuration asks
    a, b = engine.generate(ids, 2, "neutral"), engine.generate(ids, 2, "penalized")
    assert a.info["prompt_logprobs_via"] == "echo" and "prompt_logprobs" in engine.capabilities
    R = len(ids) - 2
    assert a.prompt_logprobs.shape == (R, 2) and bool((a.prompt_logprob_ids == -1).all())   # tokens named by text
    ref = torch.log_softmax(scores.float(), dim=-1)                                          # [P, V]
    want = ref[torch.arange(1, R + 1), torch.tensor(ids[2:])].double()
    err = float((a.prompt_logprobs[:, 0] - want).abs().max())
    print(f"max |echo prompt logprob - in-process log_softmax| = {err:.3g}")
    assert err <= BOUND
    assert compare(b, a)["prompt_logprobs_equal"] is True
    b.prompt_logprobs[3, 0] = torch.nextafter(b.prompt_logprobs[3, 0], torch.tensor(0.0, dtype=torch.float64))
    row = compare(b, a)
    assert row["first_differing_prompt_logprob_row"] == 3 and row["verdict"].startswith("differs: prompt logprobs")
