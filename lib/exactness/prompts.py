"""The real prompts: text this project did not write, present identically on every machine without a download.

The text comes from the installed sources of mpmath 1.3.0 (BSD licence), which the CPU machines and the GPU machine
both carry. Each prompt is a fixed byte range, pinned by SHA-256; a machine whose text differs fails to build the
prompt (``PromptPinError``) unless ``allow_unpinned=True``, and the receipt records the hash either way.

    short  40 tokens      the opening of the ``pi`` entry of mpmath/function_docs.py
    code   16,022 tokens  mpmath/libmp/libmpf.py, libelefun.py, libmpc.py, each after a ``# mpmath/<path>`` line
    docs   12,780 tokens  the start of mpmath/function_docs.py (the documentation of mpmath's functions)

Token counts are for the byte tokenizer (bytes + BOS).

The user's own prompts (.txt and .jsonl files) mix with these names in one list: prompt_files.py reads them and
builds the whole list for our engine (a chat prompt through :func:`plain_chat_text`).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from .tokenizer import ByteTokenizer


class PromptPinError(RuntimeError):
    """The prompt text on this machine differs from its SHA-256 pin."""


@dataclass(frozen=True)
class PromptSpec:
    """A pinned byte range of mpmath's sources: ``n_bytes`` bytes of ``files`` joined, starting at ``marker``."""

    name: str
    files: tuple[str, ...]
    n_bytes: int
    sha256: str
    marker: bytes | None = None
    headers: bool = False


PROMPTS: dict[str, PromptSpec] = {
    "short": PromptSpec("short", ("function_docs.py",), 39,
                        "2df35c849eafd56b624762e2fab3b58dcf9157e73279b2c28b526dc411f9855a", marker=b"`\\pi`, roughly equal"),
    "code": PromptSpec("code", ("libmp/libmpf.py", "libmp/libelefun.py", "libmp/libmpc.py"), 16021,
                       "1862f7cfb7651cc45dd1e017caa5303e92ceb4285c7b0d2f5c4ab33a1c9b1b9b", headers=True),
    "docs": PromptSpec("docs", ("function_docs.py",), 12779,
                       "5ef7b50d6c162a1144e0659abf2b20d026175694283b4018a70d287144c8e53e"),
}


@dataclass(frozen=True)
class Prompt:
    """A built prompt: its text bytes (empty for an ids prompt), token ids [n] int64, its SHA-256 (a built-in
    prompt: of the bytes used; a file prompt: of the prompt as given, prompt_files.py), whether the full text
    matched its pin (always True for a file prompt), its kind (builtin, text, ids, chat), the file it came from and
    the chat template that made its text (``plain`` for chat prompts, else None)."""

    name: str
    text: bytes
    ids: torch.Tensor
    sha256: str
    pinned_sha256: str
    pin_ok: bool
    kind: str = "builtin"
    file: str | None = None
    template: str | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.ids.numel())


def _mpmath_root() -> str:
    import mpmath
    return os.path.dirname(mpmath.__file__)


def prompt_text(spec: PromptSpec) -> bytes:
    """The spec's bytes as found on this machine (not yet checked against the pin)."""
    root = _mpmath_root()
    parts = []
    for f in spec.files:
        with open(os.path.join(root, f), "rb") as fh:
            data = fh.read()
        parts.append((b"# mpmath/" + f.encode() + b"\n" if spec.headers else b"") + data)
    blob = b"".join(parts)
    start = blob.index(spec.marker) if spec.marker else 0
    return blob[start:start + spec.n_bytes]


def build_prompt(name: str, max_tokens: int | None = None, allow_unpinned: bool = False,
                 tokenizer=None) -> Prompt:
    """Build prompt ``name``, optionally cut to its first ``max_tokens`` tokens.

    Raises:
        ValueError: unknown name (lists the known ones) or max_tokens < 2.
        PromptPinError: the text differs from its pin and ``allow_unpinned`` is False.
    """
    if name not in PROMPTS:
        raise ValueError(f"unknown prompt {name!r}; known prompts: {', '.join(PROMPTS)}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (BOS + one byte), got {max_tokens}")
    spec = PROMPTS[name]
    try:
        text = prompt_text(spec)
    except (OSError, ValueError) as e:
        if not allow_unpinned:
            raise PromptPinError(f"prompt {name!r}: mpmath sources unreadable or changed ({e})") from e
        text = b""
    full_sha = hashlib.sha256(text).hexdigest()
    if full_sha != spec.sha256 and not allow_unpinned:
        import mpmath
        raise PromptPinError(f"prompt {name!r}: text SHA-256 {full_sha} differs from the pin {spec.sha256} "
                             f"(mpmath {mpmath.__version__} at {_mpmath_root()}; the pin is mpmath 1.3.0); "
                             f"pass allow_unpinned=True to run anyway")
    tok = tokenizer or ByteTokenizer()
    if max_tokens is not None and isinstance(tok, ByteTokenizer):
        text = text[:max_tokens - 1]
    ids = tok.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return Prompt(name, text, ids, hashlib.sha256(text).hexdigest(), spec.sha256, full_sha == spec.sha256)


def plain_chat_text(messages) -> str:
    """The plain chat template, for engines whose model has no template of its own: each message as
    ``<role>: <content>`` on its own line, then ``assistant:`` (the reply follows it).

    Args:
        messages: (role, content) pairs, or {"role", "content"} dicts, or an engines.base.Chat.
    """
    pairs = getattr(messages, "messages", messages)
    pairs = [(m["role"], m["content"]) if isinstance(m, dict) else tuple(m) for m in pairs]
    return "".join(f"{role}: {content}\n" for role, content in pairs) + "assistant:"
