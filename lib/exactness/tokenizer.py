"""Tokenizers: byte-level for the synthetic presets, and a bridge to a local checkpoint's own tokenizer."""
from __future__ import annotations

import torch


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257 (vocabulary 258, config.BYTE_VOCAB).

    ``encode`` prepends BOS; one token per byte, so a prompt of n bytes is n + 1 tokens.
    """

    name = "bytes"
    bos_id, eos_id, vocab_size = 256, 257, 258

    def encode(self, text: str | bytes) -> torch.Tensor:
        """text (str is UTF-8 encoded) -> ids [n + 1] int64, BOS first."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.tensor([self.bos_id, *data], dtype=torch.int64)

    def decode(self, ids) -> str:
        """ids -> text; special ids are dropped and invalid UTF-8 is replaced (U+FFFD)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's own tokenizer, loaded from a local folder (never downloaded).

    Raises:
        FileNotFoundError: the folder has no tokenizer files.
    """

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # optional dependency, only for real checkpoints
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise FileNotFoundError(f"no tokenizer files usable in {path!r}: {e}") from e
        self.name = f"hf:{path}"
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str | bytes) -> torch.Tensor:
        """text -> ids [n] int64 (the tokenizer's own special-token rules)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return torch.tensor(self.tok.encode(text), dtype=torch.int64)

    def decode(self, ids) -> str:
        """ids -> text."""
        return self.tok.decode([int(i) for i in ids])
