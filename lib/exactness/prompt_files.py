"""Prompt files: the user's own prompts, mixed with the built-in names (prompts.PROMPTS) in one ``prompts`` list.

An entry of the list is a built-in name, or a path to a file:

    name.txt     one prompt, named by the file's stem: the file's UTF-8 text
    name.jsonl   one prompt per line, each a JSON object with a "name" and exactly one of
                 "text" (a string), "ids" (a list of token ids, sent as they are) or
                 "messages" (a chat prompt: a list of {"role", "content"} strings)

Empty lines of a .jsonl file are skipped. Names are the user's (any characters) and unique across the whole list.
Each prompt is identified by its SHA-256: of its UTF-8 text, of its ids as int64 little-endian bytes, or of its
messages' canonical JSON (``[{"content", "role"}, ...]``, keys sorted, no spaces, UTF-8, non-ASCII kept).
Every defect is refused with one line (:class:`PromptFileError`) naming the file, the line and what is allowed.
:func:`build_prompts` builds a whole list for our engine (a chat prompt through prompts.plain_chat_text), and
:func:`prompt_record` is what a section's JSON records of each (name, kind, SHA-256, token count).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .prompts import PROMPTS, Prompt, build_prompt, plain_chat_text
from .tokenizer import ByteTokenizer

FILE_SUFFIXES = (".txt", ".jsonl")
KINDS = ("text", "ids", "messages")


class PromptFileError(ValueError):
    """A prompts entry or prompt file that cannot be used (one line: the file, the line, what is allowed)."""


@dataclass(frozen=True)
class PromptSource:
    """One prompt as the user gave it, before any tokenizer.

    Attributes:
        name: the prompt's name (unique in the run).
        kind: ``builtin`` (prompts.PROMPTS), ``text``, ``ids`` or ``chat``.
        text: the text (kind text), else None.
        ids: the token ids (kind ids), else None.
        messages: ((role, content), ...) (kind chat), else None.
        file: the file it came from (None for a built-in prompt).
        sha256: hex SHA-256 of the prompt as given (see the module docstring); None for a built-in prompt
            (its pin is prompts.PROMPTS[name].sha256).
    """

    name: str
    kind: str
    text: str | None = None
    ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    file: str | None = None
    sha256: str | None = None


def is_file_entry(entry) -> bool:
    """Whether a prompts entry names a prompt file (ends in .txt or .jsonl) rather than a built-in prompt."""
    return isinstance(entry, str) and entry.lower().endswith(FILE_SUFFIXES)


def ids_sha256(ids) -> str:
    """SHA-256 of token ids as int64 little-endian bytes."""
    return hashlib.sha256(np.asarray(list(ids), dtype="<i8").tobytes()).hexdigest()


def messages_sha256(messages) -> str:
    """SHA-256 of the canonical JSON of (role, content) pairs (module docstring)."""
    blob = json.dumps([{"role": r, "content": c} for r, c in messages], ensure_ascii=False, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise PromptFileError(f"prompt file {path!r} is unreadable: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"prompt file {path!r} is not UTF-8 (byte {e.start}); prompt files are UTF-8 "
                              "text") from None


def _text_prompt(path: str) -> PromptSource:
    text = _read(path)
    if not text:
        raise PromptFileError(f"prompt file {path!r} is empty; a .txt prompt file holds one non-empty prompt")
    name = os.path.splitext(os.path.basename(path))[0]
    return PromptSource(name, "text", text=text, file=path, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def _messages(where: str, value) -> tuple[tuple[str, str], ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(m[k], str) for k in m)
        for m in value)
    if not ok:
        raise PromptFileError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": "
                              f"str}} objects, got {json.dumps(value)[:80]}")
    if not any(m["content"] for m in value):
        raise PromptFileError(f"{where}: the prompt is empty (every message's content is empty)")
    return tuple((m["role"], m["content"]) for m in value)


def _line_prompt(where: str, path: str, line: str) -> PromptSource:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line is "
                              '{"name": ..., "text" | "ids" | "messages": ...}') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise PromptFileError(f"{where}: each line is a JSON object with a non-empty string \"name\"")
    given = [k for k in KINDS if k in obj]
    extra = sorted(set(obj) - {"name", *KINDS})
    if len(given) != 1 or extra:
        keys = " and ".join(f'"{k}"' for k in given) or "none of \"text\", \"ids\", \"messages\""
        raise PromptFileError(f"{where}: prompt {obj['name']!r} gives {keys}"
                              f"{' and unknown keys ' + ', '.join(extra) if extra else ''}; allowed: exactly one of "
                              "\"text\", \"ids\" or \"messages\" besides \"name\"")
    name, kind, value = obj["name"], given[0], obj[given[0]]
    if kind == "text":
        if not isinstance(value, str) or not value:
            raise PromptFileError(f"{where}: prompt {name!r}: \"text\" must be a non-empty string")
        return PromptSource(name, "text", text=value, file=path,
                            sha256=hashlib.sha256(value.encode("utf-8")).hexdigest())
    if kind == "ids":
        if (not isinstance(value, list) or not value
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
            raise PromptFileError(f"{where}: prompt {name!r}: \"ids\" must be a non-empty list of token ids "
                                  "(ints >= 0)")
        return PromptSource(name, "ids", ids=tuple(value), file=path, sha256=ids_sha256(value))
    msgs = _messages(f"{where}: prompt {name!r}", value)
    return PromptSource(name, "chat", messages=msgs, file=path, sha256=messages_sha256(msgs))


def read_prompt_file(path: str) -> list[PromptSource]:
    """The prompts of one .txt or .jsonl file.

    Raises:
        PromptFileError: unreadable, not UTF-8, an empty prompt or file, a line that is not valid JSON or has not
            exactly one of text/ids/messages (one line naming the file and line).
    """
    if not is_file_entry(path):
        raise PromptFileError(f"prompt file {path!r} is not allowed; allowed: a .txt or .jsonl file")
    if path.lower().endswith(".txt"):
        return [_text_prompt(path)]
    out = [_line_prompt(f"prompt file {path!r} line {n}", path, line)
           for n, line in enumerate(_read(path).splitlines(), 1) if line.strip()]
    if not out:
        raise PromptFileError(f"prompt file {path!r} holds no prompt; a .jsonl prompt file holds one JSON "
                              "object per line")
    return out


def resolve(entries) -> list[PromptSource]:
    """The prompts of a ``prompts`` list: built-in names as they are, files expanded in order.

    Raises:
        PromptFileError: an entry that is neither a built-in name nor a .txt/.jsonl path, a bad file, or a name
            given twice (names both places).
    """
    if not isinstance(entries, (list, tuple)) or not entries:
        raise PromptFileError(f"prompts must be a non-empty list of built-in names ({', '.join(PROMPTS)}) or "
                              f".txt/.jsonl files, got {entries!r}")
    out, seen = [], {}
    for entry in entries:
        if isinstance(entry, str) and entry in PROMPTS:
            found = [PromptSource(entry, "builtin")]
        elif is_file_entry(entry):
            found = read_prompt_file(entry)
        else:
            raise PromptFileError(f"prompts entry {entry!r} is not allowed; allowed: a built-in prompt "
                                  f"({', '.join(PROMPTS)}) or a path to a .txt or .jsonl prompt file")
        for s in found:
            if s.name in seen:
                raise PromptFileError(f"prompt name {s.name!r} is given twice ({seen[s.name]} and "
                                      f"{s.file or 'built-in'}); prompt names must be unique")
            seen[s.name] = s.file or "built-in"
        out += found
    return out


def absolute_entries(entries: list) -> list:
    """``entries`` with every prompt-file path made absolute (notebooks run in their own folder)."""
    return [os.path.abspath(e) if is_file_entry(e) else e for e in entries]


def check_vocab(sources: list[PromptSource], vocab: int, model: str) -> None:
    """Refuse an ids prompt holding an id outside ``0..vocab-1``.

    Raises:
        PromptFileError: naming the prompt, the first bad id, its position and the vocabulary.
    """
    for s in sources:
        bad = next(((i, t) for i, t in enumerate(s.ids or ()) if t >= vocab), None)
        if bad:
            raise PromptFileError(f"prompt {s.name!r}: id {bad[1]} at position {bad[0]} is outside the vocabulary "
                                  f"of {model} (ids 0..{vocab - 1})")


# ------------------------------------------------------------------------------------------- building for our engine

def build_source(source, max_tokens: int | None = None, allow_unpinned: bool = False, tokenizer=None) -> Prompt:
    """Build one prompt_files.PromptSource for our engine, cut to its first ``max_tokens`` tokens: a built-in one
    as build_prompt does, text through the tokenizer, ids as they are, chat through plain_chat_text.

    Raises:
        ValueError: max_tokens < 2; PromptPinError: see build_prompt.
    """
    if source.kind == "builtin":
        return build_prompt(source.name, max_tokens, allow_unpinned, tokenizer)
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (BOS + one byte), got {max_tokens}")
    tok = tokenizer or ByteTokenizer()
    template = "plain" if source.kind == "chat" else None
    if source.kind == "ids":
        text, ids = b"", torch.tensor(source.ids, dtype=torch.int64)
    else:
        text = (plain_chat_text(source.messages) if template else source.text).encode("utf-8")
        if max_tokens is not None and isinstance(tok, ByteTokenizer):
            text = text[:max_tokens - 1]
        ids = tok.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return Prompt(source.name, text, ids, source.sha256, source.sha256, True, source.kind, source.file, template)


def build_prompts(entries, max_tokens: int | None = None, allow_unpinned: bool = False, tokenizer=None,
                  vocab: int | None = None) -> list[Prompt]:
    """Every prompt of a ``prompts`` list (built-in names and prompt files, prompt_files.resolve), built for our
    engine and cut to ``max_tokens`` tokens.

    Raises:
        prompt_files.PromptFileError: a bad entry or file, a repeated name, an id outside ``vocab`` (when given);
        ValueError / PromptPinError: see build_source.
    """
    sources = resolve(entries)
    if vocab is not None:
        check_vocab(sources, vocab, "the model")
    return [build_source(s, max_tokens, allow_unpinned, tokenizer) for s in sources]


def prompt_record(prompt: Prompt) -> dict:
    """What a section's JSON records of a prompt: name, kind, sha256, tokens (after the cut), file, template."""
    return {"name": prompt.name, "kind": prompt.kind, "sha256": prompt.sha256, "tokens": prompt.n_tokens,
            "file": prompt.file, "template": prompt.template}
