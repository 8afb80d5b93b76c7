"""Train the embedded tiny model's byte-level BPE tokenizer from text that ships in the repo."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shared.protocol.chat import BOS, EOS, SPECIAL_TOKENS

CORPUS = Path(__file__).with_name("data") / "corpus.txt"


def train_tokenizer(vocab_size: int, out_file: Path, texts: list[str] | None = None) -> Tokenizer:
    """Byte-level BPE; BOS = id 0, EOS = id 1 as in DeepSeek's vocabulary, then DeepSeek's chat special
    tokens (<｜User｜>, <｜Assistant｜>, <think>, </think>). Trained on `texts` (one line each), or on the
    small text in the repo. Deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        special_tokens=[BOS, EOS, *(t for t in SPECIAL_TOKENS if t not in (BOS, EOS))],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    if texts is None:
        tok.train([str(CORPUS)], trainer)
    else:
        tok.train_from_iterator([t + "\n" for t in texts], trainer, length=len(texts))
    tok.save(str(out_file))
    return tok
