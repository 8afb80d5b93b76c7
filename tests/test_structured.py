"""Structured outputs (llguidance): every output under a JSON schema parses and validates, through
`pdserve up` and the openai SDK on the trained demo model and on the random tiny one, greedy and sampled,
whole and streamed; a constrained request leaves its batch neighbours alone; regex
and choice constraints hold; MTP's drafts never break the grammar (greedy output equals constrained
non-speculative decoding); a bad or unsatisfiable constraint is refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from router.cli import up_cluster
from shared.engine import LLM, SamplingParams
from shared.protocol.structured import ConstraintKind, StructuredOutput

DEMO, TINY = "models/demo-v32", "models/tiny-v32"
PROMPTS = ["In the beginning God created", "And the LORD said unto Moses", "Who is the LORD?", "Blessed are"]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"book": {"enum": ["Genesis", "Exodus", "Psalms"]},
                                      "verses": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                            "maximum": 50},
                                                 "minItems": 1, "maxItems": 4}},
     "required": ["book", "verses"], "additionalProperties": False},
    {"type": "object", "properties": {"who": {"type": "object", "properties": {
        "first": {"type": "string", "maxLength": 8}, "tribe": {"enum": ["Judah", "Levi"]}},
        "required": ["first", "tribe"], "additionalProperties": False},
        "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25}, "ok": {"type": "boolean"}},
     "required": ["who", "score", "ok"], "additionalProperties": False},
]


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(DEMO)


@pytest.fixture(scope="module", params=[DEMO, TINY])
def served(request, tmp_path_factory):
    """`pdserve up --http-port 0` on the model, and an openai client of it."""
    c = up_cluster(["--model", request.param, "--port", "0", "--http-port", "0"],
                   log_dir=tmp_path_factory.mktemp("structured-logs"))
    with c:
        client = openai.OpenAI(base_url=f"http://{c.http_address}/v1", api_key="unused", max_retries=0)
        yield client, client.models.list().data[0].id


def test_every_output_under_a_schema_validates_through_the_api(served):
    """Each schema under response_format json_schema (strict), chat and completions, whole and streamed,
    greedy and sampled: every output parses and validates, and the grammar ends it (finish_reason stop)."""
    client, model = served
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[i]}],
                                              max_tokens=200, temperature=0, response_format=fmt)
        sampled = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=200, temperature=1.0,
                                            seed=i, n=2, extra_body={"response_format": fmt})
        streamed = client.completions.create(model=model, prompt=PROMPTS[-1], max_tokens=200, temperature=0.7, seed=9,
                                             stream=True, extra_body={"response_format": fmt})
        texts = [chat.choices[0].message.content, *(c.text for c in sampled.choices),
                 "".join(c.choices[0].text for c in streamed if c.choices)]
        assert chat.choices[0].finish_reason == "stop" and {c.finish_reason for c in sampled.choices} == {"stop"}
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


def test_a_constrained_request_leaves_its_neighbours_alone(demo):
    """All schemas in one batch with an unconstrained neighbour, whose output is the same as alone."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = demo.generate([PROMPTS[0]], free)[0].token_ids
    for temperature in (0.0, 1.0):
        params = [SamplingParams(max_tokens=160, temperature=temperature, seed=7 + i, structured=json_schema(s))
                  for i, s in enumerate(SCHEMAS)]
        outs = demo.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))] + [PROMPTS[0]], params + [free])
        for schema, out in zip(SCHEMAS, outs, strict=False):
            assert out.finish_reason == "stop", out.text  # the grammar ended it, not the length
            jsonschema.validate(json.loads(out.text), schema)
        assert outs[-1].token_ids == alone


def test_regex_choice_and_grammar_hold(demo):
    regex = StructuredOutput(ConstraintKind.REGEX, r"[A-Z][a-z]{2,6} [0-9]{1,3}")
    choice = StructuredOutput(ConstraintKind.CHOICE, choices=("light", "darkness", "waters"))
    gbnf = StructuredOutput(ConstraintKind.GRAMMAR, 'root ::= "Amen" ("," " Amen")*')
    outs = demo.generate(PROMPTS[:3], [SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=c)
                                       for c in (regex, choice, gbnf)])
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{1,3}", outs[0].text), outs[0].text
    assert outs[1].text in choice.choices and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"Amen(, Amen)*", outs[2].text), outs[2].text
    obj = demo.generate(PROMPTS[:1], SamplingParams(max_tokens=120, temperature=0.0,
                                                    structured=StructuredOutput(ConstraintKind.JSON_OBJECT)))[0]
    assert isinstance(json.loads(obj.text), dict)


def test_mtp_drafts_never_break_the_grammar(demo):
    """Greedy constrained decoding with MTP K = 2 gives exactly the non-speculative constrained output; the
    drafts were verified under the grammar's masks (some were drafted, and all outputs validate)."""
    mtp = LLM(DEMO, speculative="mtp", num_speculative_tokens=2)
    params = [SamplingParams(max_tokens=160, temperature=0.0, structured=json_schema(s)) for s in SCHEMAS]
    prompts = PROMPTS[: len(SCHEMAS)]
    want = [o.text for o in demo.generate(prompts, params)]
    got = mtp.generate(prompts, params)
    assert [o.text for o in got] == want
    assert sum(mtp.engine.speculator.stats.drafted) > 0
    sampled = mtp.generate(prompts, [SamplingParams(max_tokens=160, temperature=1.0, seed=5, structured=json_schema(s))
                                     for s in SCHEMAS])
    for schema, out in zip(SCHEMAS, sampled, strict=True):
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize(("constraint", "match"), [
    (StructuredOutput(ConstraintKind.JSON_SCHEMA, '{"type": "nonsense"}'), "structured_output.json_schema"),
    (StructuredOutput(ConstraintKind.JSON_SCHEMA, "{not json"), "structured_output.json_schema: not valid JSON"),
    (StructuredOutput(ConstraintKind.REGEX, "(("), "structured_output.regex"),
    (StructuredOutput(ConstraintKind.GRAMMAR, "root ::= ((("), "structured_output.grammar"),
    (StructuredOutput(ConstraintKind.CHOICE, choices=()), "structured_output.choice"),
    (StructuredOutput(ConstraintKind.REGEX, "x" * (65 << 10)), "structured_output.regex: at most"),
])
def test_bad_constraints_are_refused_naming_the_field(demo, constraint, match):
    with pytest.raises(ValueError, match=match):
        demo.generate(["hi"], SamplingParams(max_tokens=4, structured=constraint))
    assert not demo.engine.has_work
