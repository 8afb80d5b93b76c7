"""Tokenizer wrapper over Hugging Face `tokenizers` (tokenizer.json), with incremental detokenizing."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None = None):
        self._tok = _HFTokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.vocab_size = self._tok.get_vocab_size()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, bos_token_id: int | None) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return cls(path, bos_token_id) if path.exists() else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Emits only complete new text: holds back while the tail is a partial UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, output_ids: list[int]) -> str:
        full = self.tokenizer.decode(output_ids)
        if full.endswith("\ufffd"):
            return ""
        new = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return new
