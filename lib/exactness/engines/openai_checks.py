"""What the ``openai`` engine checks in a server's replies (engines/openai.py): the sampling knobs sent at their
neutral values, whether each chosen token was the top-1 (greedy), what a text-only reply lost, and the prompt
tokens' logprobs (vLLM's ``prompt_logprobs`` or the legacy ``echo`` + ``logprobs``) as exact tensors.

Prompt logprobs as tensors (one row per prompt token the server gave a logprob, i.e. after the first):
    lp   [R, 1+N] float64: the prompt token's logprob, then the top-N logprobs best first (-inf where fewer came)
    ids  [R, 1+N] int64: the prompt token's id, then the top-N ids (-1 where the server named a token by its text
         only, or where fewer came)
JSON floats parse to the float64 the server wrote, so two configurations' rows compare exactly as bytes.
"""
from __future__ import annotations

import math

import torch

# Each knob that can move greedy decoding, at its neutral value, under the names vLLM, SGLang, llama.cpp's server
# and llama-cpp-python's server use; a server ignores the names it does not know.
NEUTRAL_SAMPLING = {
    "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "typical_p": 1, "tfs_z": 1,
    "repetition_penalty": 1.0,   # vLLM, SGLang
    "repeat_penalty": 1.0,       # llama.cpp (its Python server's default is 1.1)
    "presence_penalty": 0, "frequency_penalty": 0, "seed": 0,
    "mirostat_mode": 0,          # llama-cpp-python
    "mirostat": 0,               # llama.cpp's own server
}


def sampling_knobs(*overrides) -> dict:
    """NEUTRAL_SAMPLING updated by each ``sampling`` mapping in turn (a None value drops the knob).

    Raises:
        ValueError: a mapping that is not {name: number, bool, string or null}.
    """
    out = dict(NEUTRAL_SAMPLING)
    for o in overrides:
        if o is None:
            continue
        bad = not isinstance(o, dict) or any(not isinstance(k, str) or not (v is None or isinstance(
            v, (int, float, str, bool))) for k, v in o.items())
        if bad:
            raise ValueError(f"openai engine: sampling must be a mapping of knob -> value or null (null drops the "
                             f"knob), got {o!r}")
        for k, v in o.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
    return out


def refused_knob(message: str, knobs: dict) -> str:
    """A hint where an error message names a sampling knob that was sent, else ''."""
    hit = [k for k in knobs if k in message and k != "seed"]
    if not hit:
        return ""
    k = max(hit, key=len)
    return (f" (the server may refuse the sampling knob {k}={knobs[k]!r}: set `sampling: {{{k}: <a value it takes>}}`"
            f" or `{{{k}: null}}` in the engine file)")


# ------------------------------------------------------------------------------------------------------ greedy

def _ambiguous(key) -> bool:
    """A token named by a text that several tokens share (a dropped or replaced invalid byte)."""
    return key == "" or (isinstance(key, str) and "\ufffd" in key)


def greedy_check(chosen: list, tops: list, asked: int, tokens: int | None = None) -> tuple[bool | None, dict]:
    """Whether every chosen token was the top-1 of its row (a tie at equal logprob counts as top-1).

    Args:
        chosen: per generated token, its logprob (None where the server gave none).
        tops: per generated token, (pairs [(key, logprob)], keyed_by_text): key a token id, or the token's text
            where ``keyed_by_text`` (a dict keyed by text loses tokens whose texts collide).
        asked: the top-N asked; tokens: the number of generated tokens where known.
    Returns:
        (True, {"positions"}) all rows checked and none off; (False, {position, chosen_logprob, top1_logprob,
        top1_token}) at the first row where the chosen token's logprob is below the largest listed; (None,
        {"not_checked": why}) where no logprobs came, their count is not the token count, or some row is keyed by
        a text several tokens share (a held-back or dropped invalid byte: such a row may pair one token's text with
        another's logprob, so it proves nothing either way).
    """
    if asked == 0 or not chosen:
        return None, {"not_checked": "no logprobs were asked or none came back"}
    if len(chosen) != len(tops) or (tokens is not None and tokens != len(chosen)):
        return None, {"not_checked": f"{len(chosen)} logprob entries for {tokens} generated tokens"}
    unsure = []
    for i, (lp, (pairs, by_text)) in enumerate(zip(chosen, tops)):
        if lp is None or not pairs or by_text and (len(pairs) < asked or any(_ambiguous(k) for k, _ in pairs)):
            unsure.append(i)
            continue
        key, best = max(pairs, key=lambda p: p[1])
        if float(lp) < float(best):
            return False, {"position": i, "chosen_logprob": float(lp), "top1_logprob": float(best),
                           "top1_token": key}
    if unsure:
        return None, {"not_checked": f"{len(unsure)} of {len(chosen)} positions have no logprob or top-N keyed by "
                                     f"texts that several tokens share (first at {unsure[0]})"}
    return True, {"positions": len(chosen)}


# -------------------------------------------------------------------------------------------------------- loss

def lost_facts(text: str, usage: dict | None, max_tokens: int, counted: int | None, chunks: int,
               empty_tokens: int) -> list[str]:
    """What a text-only reply may have lost: U+FFFD in the text, a completion token count other than asked or
    than counted (logprob entries, else content chunks), tokens that came back as empty text."""
    out = []
    if "\ufffd" in text:
        out.append(f"the text holds {text.count(chr(0xFFFD))} U+FFFD (replaced invalid bytes)")
    n = (usage or {}).get("completion_tokens")
    if isinstance(n, int) and n != max_tokens:
        out.append(f"usage.completion_tokens {n} != max_tokens {max_tokens}")
    seen = counted if counted is not None else chunks
    what = "logprob entries" if counted is not None else "content chunks"
    if isinstance(n, int) and n != seen:
        out.append(f"usage.completion_tokens {n} != {seen} {what} received")
    elif n is None and seen != max_tokens:
        out.append(f"{seen} {what} received for max_tokens {max_tokens} (no usage)")
    if empty_tokens:
        out.append(f"{empty_tokens} tokens came back as empty text (bytes dropped by the server)")
    return out


# ---------------------------------------------------------------------------------------------- prompt logprobs

def _key_id(key) -> int:
    """``token_id:<id>`` or ``<id>`` -> id; a token named by its text -> -1."""
    s = str(key)
    s = s[9:] if s.startswith("token_id:") else s
    return int(s) if s.lstrip("-").isdigit() else -1


def _tensors(rows: list[tuple[int, float, list]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(prompt id, its logprob, [(id, logprob)] best first)] -> (lp [R, 1+n] float64, ids [R, 1+n] int64)."""
    lp = torch.full((len(rows), 1 + n), -math.inf, dtype=torch.float64)
    ids = torch.full((len(rows), 1 + n), -1, dtype=torch.int64)
    for r, (tid, tlp, top) in enumerate(rows):
        lp[r, 0], ids[r, 0] = float(tlp), tid
        for c, (i, v) in enumerate(top[:n]):
            lp[r, 1 + c], ids[r, 1 + c] = float(v), i
    return lp, ids


def parse_vllm(plp, prompt_ids: list[int] | None, n: int):
    """vLLM's ``prompt_logprobs`` list ([None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]) -> tensors.
    The prompt token of row r is the entry keyed by prompt_ids[r + 1] where known, else the one of largest rank.

    Raises:
        ValueError: not that shape (the message says what was found).
    """
    if not isinstance(plp, list) or len(plp) < 2 or plp[0] is not None:
        raise ValueError(f"prompt_logprobs is not [None, {{...}}, ...]: {str(plp)[:200]}")
    rows = []
    for r, d in enumerate(plp[1:]):
        if not isinstance(d, dict) or not d or not all(isinstance(v, dict) and "logprob" in v for v in d.values()):
            raise ValueError(f"prompt_logprobs row {r + 1} is not {{id: {{logprob, rank}}}}: {str(d)[:200]}")
        entries = sorted(((_key_id(k), v) for k, v in d.items()), key=lambda e: (e[1].get("rank") or 0, e[0]))
        want = prompt_ids[r + 1] if prompt_ids is not None and r + 1 < len(prompt_ids) else None
        own = next((e for e in entries if e[0] == want), entries[-1])
        top = [(i, v["logprob"]) for i, v in entries if (v.get("rank") or n + 1) <= n]
        rows.append((own[0], own[1]["logprob"], top))
    return _tensors(rows, n)


def parse_echo(logprobs, completion_tokens: int, n: int):
    """The legacy ``logprobs`` object of an echo reply (prompt tokens first, the first with token_logprobs None,
    then ``completion_tokens`` generated ones) -> tensors of the prompt rows after the first.

    Raises:
        ValueError: no prompt rows, or not that shape.
    """
    if not isinstance(logprobs, dict):
        raise ValueError(f"no logprobs object in the echo reply: {str(logprobs)[:200]}")
    toks, lps, tops = (logprobs.get(k) for k in ("tokens", "token_logprobs", "top_logprobs"))
    if not (isinstance(toks, list) and isinstance(lps, list) and isinstance(tops, list)):
        raise ValueError(f"the echo reply's logprobs lack tokens / token_logprobs / top_logprobs lists: "
                         f"{str(logprobs)[:200]}")
    P = len(toks) - completion_tokens
    if P < 2 or lps[0] is not None:
        raise ValueError(f"the echo reply lists {P} prompt tokens (the first with a logprob: {lps[0]!r}); "
                         "the server did not echo the prompt's logprobs")
    rows = []
    for r in range(1, P):
        if lps[r] is None or not isinstance(tops[r], dict):
            raise ValueError(f"echo prompt row {r} has no logprob or top_logprobs: {lps[r]!r}")
        top = sorted(((_key_id(k), float(v)) for k, v in tops[r].items()), key=lambda p: (-p[1], p[0]))
        rows.append((_key_id(toks[r]), lps[r], top))
    return _tensors(rows, n)
