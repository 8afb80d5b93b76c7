"""The demo's corpus: the King James Bible out of Debian's bible-kjv-text (`bible.data`: LZW blocks behind a
block table) or a text file, its BPE tokenizer, and the token windows training reads."""

from __future__ import annotations

import hashlib
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.demo.recipe import MAKE_HINT
from shared.loader.tokenizer_train import train_tokenizer as train_bpe


@dataclass
class Corpus:
    verses: list[str]
    info: dict[str, Any]


def decode_bible_data(raw: bytes) -> str:
    """`bible.data` of bible-kjv: 'EC02Compressed Data File', then at 0x50 big-endian u32s (0, block
    size, block count, block offsets + end); the first block keeps compress's 3-byte magic, the others
    are bare LZW streams, so each gets the magic prepended and goes through `gzip -dc`."""
    if not raw.startswith(b"EC02"):
        raise ValueError("not a bible-kjv compressed data file (no EC02 magic)")
    _, _, count = struct.unpack(">3I", raw[0x50:0x5C])
    offsets = struct.unpack(f">{count + 1}I", raw[0x5C : 0x5C + 4 * (count + 1)])
    magic = raw[offsets[0] - 3 : offsets[0]]
    parts = []
    for i in range(count):
        done = subprocess.run(["gzip", "-dc"], input=magic + raw[offsets[i] : offsets[i + 1]],
                              capture_output=True, check=True)
        parts.append(done.stdout)
    return b"".join(parts).decode("latin-1")


def read_corpus(path: str | Path) -> Corpus:
    """The verses, one a line, without their references ('Ge1:1 In the beginning' → 'In the
    beginning'), and what identifies the corpus (package, version, sha256 of the file read)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} not found: {MAKE_HINT}")
    raw = path.read_bytes()
    text = decode_bible_data(raw) if raw.startswith(b"EC02") else raw.decode("utf-8")
    lines = [ln.strip() for ln in text.splitlines()]
    ref = re.compile(r"^[0-9]?[A-Za-z]+[0-9]+:[0-9]+\s+")
    verses = [ref.sub("", ln) for ln in lines if ref.match(ln)]
    if not verses:
        verses = [ln for ln in lines if ln]
    info: dict[str, Any] = {"file": path.name, "sha256": hashlib.sha256(raw).hexdigest(),
                            "verses": len(verses), "characters": sum(len(v) + 1 for v in verses)}
    control = next((p / "DEBIAN" / "control" for p in path.parents if (p / "DEBIAN" / "control").exists()), None)
    if control is not None:
        fields = dict(ln.split(": ", 1) for ln in control.read_text().splitlines() if ": " in ln)
        info.update(package=fields.get("Package"), version=fields.get("Version"))
    else:
        info.update(package=None, version=None)
    return Corpus(verses, info)


def train_tokenizer(verses: list[str], vocab_size: int, out_file: Path) -> Any:  # tokenizers.Tokenizer
    """Byte-level BPE on the training verses, with the special tokens of shared.loader.tokenizer_train
    (BOS id 0, EOS id 1, then DeepSeek's chat tokens). Deterministic."""
    return train_bpe(vocab_size, out_file, verses)


@dataclass
class TokenSplit:
    ids: torch.Tensor  # all tokens of the split, verse after verse ('\n' ends each)
    starts: torch.Tensor  # token offset of each verse

    def windows(self, seq_len: int) -> list[int]:
        """Verse-aligned starts of consecutive, non-overlapping evaluation windows."""
        out, nxt = [], 0
        for s in self.starts.tolist():
            if s >= nxt and s + seq_len - 1 <= len(self.ids):
                out.append(s)
                nxt = s + seq_len - 1
        return out


def tokenize(tok: Any, verses: list[str]) -> TokenSplit:
    enc = tok.encode_batch([v + "\n" for v in verses], add_special_tokens=False)
    lengths = torch.tensor([len(e.ids) for e in enc])
    starts = torch.cumsum(lengths, 0) - lengths
    return TokenSplit(torch.tensor([i for e in enc for i in e.ids], dtype=torch.long), starts)


def make_batch(split: TokenSplit, starts: list[int], seq_len: int, bos: int, device: torch.device) -> torch.Tensor:
    """[B, seq_len + 1]: BOS then the seq_len tokens from each start (inputs [:, :-1], targets [:, 1:])."""
    rows = [torch.cat([torch.tensor([bos]), split.ids[s : s + seq_len]]) for s in starts]
    return torch.stack(rows).to(device)
