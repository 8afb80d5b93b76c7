"""Structured outputs: the constraint a request puts on its output (JSON schema, any JSON object, a
regex, a grammar, a choice of strings) and its compilation into an llguidance grammar.

llguidance (Microsoft's Rust grammar engine, on PyPI with no dependencies) is the back-end: it takes
JSON schemas, regexes and Lark grammars (GBNF / EBNF converts to Lark) and computes a request's
allowed-token bitmask in tens of microseconds, with `rollback` and draft-token masks for speculative
decoding. It imports no torch, so the router validates a constraint with the very compiler the
engine uses, before any work. xgrammar was the other candidate; it pulls triton and torch.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import llguidance

MAX_SPEC_BYTES = 64 << 10  # a schema, regex or grammar
MAX_CHOICES, MAX_CHOICE_BYTES = 256, 1024
COMPILED_CACHE_SIZE = 256  # compiled constraints kept per process (least recently used dropped)
# Parser limits, so a hostile grammar costs bounded time: llguidance's defaults, with less lexer fuel
# per token (each mask step runs inside the engine's step).
LIMITS = llguidance.LLParserLimits(step_lexer_fuel=100_000, step_max_items=20_000)


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"  # Lark, or GBNF / EBNF (`::=` rules)
    CHOICE = "choice"


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `after_reasoning`: thinking mode; the constraint applies
    from the token after `</think>` on (the reasoning is free text)."""

    kind: ConstraintKind
    spec: str = ""  # the schema (JSON text), regex or grammar; empty for JSON_OBJECT and CHOICE
    choices: tuple[str, ...] = field(default_factory=tuple)
    after_reasoning: bool = False

    def validate(self) -> None:
        """Sizes and shapes, before anything is compiled; ValueError naming the field."""
        name = f"structured_output.{self.kind.value}"
        if len(self.spec.encode()) > MAX_SPEC_BYTES:
            raise ValueError(f"{name}: at most {MAX_SPEC_BYTES} bytes, got {len(self.spec.encode())}")
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR) and not self.spec:
            raise ValueError(f"{name}: must not be empty")
        if self.kind is ConstraintKind.CHOICE:
            if not 0 < len(self.choices) <= MAX_CHOICES:
                raise ValueError(f"{name}: 1 to {MAX_CHOICES} choices, got {len(self.choices)}")
            if any(not 0 < len(c.encode()) <= MAX_CHOICE_BYTES for c in self.choices):
                raise ValueError(f"{name}: each choice needs 1 to {MAX_CHOICE_BYTES} bytes")
        if self.kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(f"{name}: not valid JSON ({exc})") from exc
            if not isinstance(schema, dict | bool):
                raise ValueError(f"{name}: a JSON schema is an object or a boolean")

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        return self.kind, self.spec, self.choices

    def grammar(self) -> str:
        """The llguidance grammar (unchecked: `check` or LLMatcher reports errors)."""
        return _grammar(self.kind, self.spec, self.choices)


@lru_cache(maxsize=256)
def _grammar(kind: ConstraintKind, spec: str, choices: tuple[str, ...]) -> str:
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                            defaults={"whitespace_flexible": False})
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is ConstraintKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:  # Lark as it is; GBNF / EBNF converted to Lark
        return llguidance.grammar_from("grammar", spec)
    except ValueError as exc:  # the GBNF converter's parse errors
        raise ValueError(f"structured_output.grammar: {_first_line(str(exc))}") from exc


class ConstraintCompiler:
    """Compiles constraints against one model's vocabulary, each once (an LRU of compiled matchers):
    the router checks a request's constraint with it before any work, the engine starts each
    constrained request from a copy of the compiled matcher."""

    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer_json, self.vocab_size, self.eos_token_ids = tokenizer_json, vocab_size, eos_token_ids
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the router compiles on its tokenizer threads

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        if self._vocabulary is None:
            if self.tokenizer_json is None:
                raise ValueError("structured_output: this model has no tokenizer.json")
            self._vocabulary = grammar_vocabulary(self.tokenizer_json, self.vocab_size, self.eos_token_ids)
        return self._vocabulary

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constraint (ValueError naming the field if it is bad)."""
        constraint.validate()
        with self._lock:
            compiled = self._compiled.get(constraint.key)
            if compiled is None:
                compiled = new_matcher(constraint, self.vocabulary)
                self._compiled[constraint.key] = compiled
                if len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint.key)
            return compiled.deep_copy()


def grammar_vocabulary(tokenizer_json: str | Path, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance reads it, sized to the model's logits (a checkpoint pads its vocabulary
    past the tokenizer's; the padding is never allowed). Building it takes about a second at DeepSeek's
    129,280 tokens: made once per process."""
    return llguidance.LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab_size, eos_token=eos_token_ids)


def new_matcher(constraint: StructuredOutput, vocabulary: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A matcher at the start of the constraint; ValueError naming the field when the grammar does not
    compile or allows no token at all from the start (the tokenizer cannot satisfy it)."""
    name = f"structured_output.{constraint.kind.value}"
    matcher = llguidance.LLMatcher(vocabulary, constraint.grammar(), log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise ValueError(f"{name}: {_first_line(matcher.get_error())}")
    if not any(matcher.compute_bitmask()):
        raise ValueError(f"{name}: no token of this model's vocabulary can start the output")
    return matcher


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "invalid"
