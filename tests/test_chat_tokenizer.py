"""DeepSeek-V3.2 chat encoding (strings worked out by hand from the published rules), the checkpoint's
tokenizer (special tokens, one BOS), incremental detokenizing and stop strings."""

from __future__ import annotations

import pytest
import torch

from shared.loader.tokenizer_train import train_tokenizer
from shared.protocol.chat import ChatMessage, render_messages, split_reasoning
from shared.protocol.tokenizer import IncrementalDetokenizer, OutputProcessor, Tokenizer

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def test_single_turn_chat_mode():
    assert render_messages([ChatMessage("user", "Hello")]) == f"{B}{U}Hello{A}</think>"


def test_single_turn_thinking_mode():
    assert render_messages([ChatMessage("user", "Hello")], thinking=True) == f"{B}{U}Hello{A}<think>"


def test_system_prompt_has_no_wrapper():
    msgs = [ChatMessage("system", "You are a helpful assistant."), ChatMessage("user", "Hi")]
    assert render_messages(msgs, thinking=True) == f"{B}You are a helpful assistant.{U}Hi{A}<think>"
    assert render_messages(msgs) == f"{B}You are a helpful assistant.{U}Hi{A}</think>"


def test_multi_turn_drops_earlier_reasoning():
    """DeepSeek's own README example: the earlier answer keeps its content, its reasoning is dropped,
    and its </think> comes from the user turn before it."""
    msgs = [ChatMessage("user", "hello"),
            ChatMessage("assistant", "Hello! I am DeepSeek.", reasoning_content="thinking..."),
            ChatMessage("user", "1+1=?")]
    assert render_messages(msgs, thinking=True) == (
        f"{B}{U}hello{A}</think>Hello! I am DeepSeek.{E}{U}1+1=?{A}<think>")
    assert render_messages(msgs) == f"{B}{U}hello{A}</think>Hello! I am DeepSeek.{E}{U}1+1=?{A}</think>"


def test_assistant_after_last_user_keeps_reasoning_in_thinking_mode():
    msgs = [ChatMessage("system", "S"), ChatMessage("user", "q"), ChatMessage("assistant", "a", "r")]
    assert render_messages(msgs, thinking=True) == f"{B}S{U}q{A}<think>r</think>a{E}"
    assert render_messages(msgs) == f"{B}S{U}q{A}</think>a{E}"
    with pytest.raises(ValueError, match="reasoning_content"):
        render_messages([ChatMessage("user", "q"), ChatMessage("assistant", "a")], thinking=True)


def test_bad_messages():
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        render_messages([ChatMessage("user", "q"), ChatMessage("tool", "x")])
    with pytest.raises(ValueError, match="empty"):
        render_messages([])


def test_split_reasoning():
    assert split_reasoning("<think>let me see</think>4") == ("let me see", "4")
    assert split_reasoning("just text") == ("", "just text")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(512, path)
    return Tokenizer(path, bos_token_id=0)


def test_special_tokens_and_one_bos(tok):
    ids = tok.encode(render_messages([ChatMessage("user", "Hello")], thinking=True))
    specials = [tok.token_to_id(t) for t in (B, U, A, "<think>")]
    assert ids[:2] == specials[:2] and ids[-2:] == specials[2:]
    assert ids.count(0) == 1  # the rendered BOS is the only one
    assert tok.encode("Hello")[0] == 0 and tok.encode(B + "Hello") == tok.encode("Hello")
    assert tok.decode(ids) == "Hello"  # special tokens skipped by default
    assert tok.decode(ids, skip_special_tokens=False).endswith(f"{A}<think>")


def test_incremental_detokenizer_equals_full_decode(tok):
    text = "Grüße, naïve café — 東京 🙂 and plain words. " * 8
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    out, windows = "", []
    for t in ids:
        out += detok.update([t])
        windows.append(len(detok.ids) - detok.prefix_offset)
    assert out == tok.decode(ids)
    assert max(windows) <= 8  # the decoded window stays short: work per token does not grow


def test_stop_strings_on_the_tail(tok):
    ids = tok.encode("alpha beta gamma delta epsilon", add_bos=False)
    proc = OutputProcessor(tok, stop=["gamma d", ""])  # an empty stop string is ignored
    streamed = ""
    for t in ids:
        streamed += proc.process([t])
        if proc.stopped:
            break
    assert proc.stopped and proc.text == "alpha beta " and streamed == "alpha beta "  # "gamma" was held back
    held = OutputProcessor(tok, stop=["zzz"])
    streamed = "".join(held.process([t]) for t in ids[:-1]) + held.process(ids[-1:], final=True)
    assert streamed == "alpha beta gamma delta epsilon" and not held.stopped
    keep = OutputProcessor(tok, skip_special_tokens=False)
    assert keep.process(tok.encode("<think>x", add_bos=False)) == "<think>x"


def test_generate_stops_at_stop_string(tmp_path):
    from shared.engine import LLM, SamplingParams
    from shared.loader.tiny import write_checkpoint

    path = write_checkpoint(tmp_path / "m", "deepseek_v32", num_hidden_layers=1)
    llm = LLM(str(path))
    full = llm.generate("Once upon", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = full.text[6:9]
    cut = llm.generate("Once upon", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_blocks  # the aborted request freed its blocks
    assert torch.is_tensor(llm.engine.kv.mla)
