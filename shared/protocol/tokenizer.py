"""Tokenizer over the checkpoint's own `tokenizer.json`, incremental detokenizing and stop strings.

Detokenizing and stop strings run where the tokens are consumed (the caller of `LLM.generate`, the
decode service's stream handler), never on the engine thread; their work per token is bounded by a
short window, not by the output length.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None = None):
        self.path = Path(path)
        self._tok = _HFTokenizer.from_file(str(path))
        self.bos_token_id = bos_token_id
        self.vocab_size = self._tok.get_vocab_size()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, bos_token_id: int | None) -> Tokenizer | None:
        path = Path(model_dir) / "tokenizer.json"
        return cls(path, bos_token_id) if path.exists() else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. a rendered chat prompt) become their ids; BOS is
        prepended unless the text already starts with it."""
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL (encode does not)
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Emits only complete new text, decoding a short window of tokens per step (prefix/read
    offsets, as vLLM does): the work per token does not grow with the output. Holds back while the
    tail is a partial UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def update(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        window = self.ids[self.prefix_offset :]
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(window, self.skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


class OutputProcessor:
    """Per request: token ids → text deltas, ending at the first stop string (not returned). A stop
    string is looked for only where it could end: in the new text plus the longest stop string's
    length before it. While stop strings are set, the last (longest - 1) characters are held back
    from the stream (they may turn out to begin a stop string) and released by the final call."""

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def process(self, token_ids: list[int], final: bool = False) -> str:
        """The text to stream for these tokens (`final`: the request ends here, release everything held)."""
        if self.detok is None or self.stopped:
            return ""
        new = self.detok.update(token_ids)
        start = len(self.text)
        self.text += new
        if new and self.stop:
            tail_from = max(0, start - self.hold)
            hits = [i for i in (self.text.find(s, tail_from) for s in self.stop) if i >= 0]
            if hits:
                self.stopped, final = True, True
                self.text = self.text[: min(hits)]
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted : end], end
        return out
