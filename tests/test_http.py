"""The OpenAI-compatible HTTP API of the router, through the official `openai` SDK against
`pdserve up --http-port 0` (one cluster for the module): completions and chat, streamed and whole,
the same tokens as the gRPC API; thinking mode's reasoning apart from the answer; OpenAI's error
bodies and status codes; a client that disconnects frees its KV blocks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest

from router.cli import up_cluster
from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import wait_for

DEMO = "models/demo-v32"
KEY = "sk-test-key"
PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"other-key\n{KEY}\n")
    c = up_cluster(["--model", DEMO, "--port", "0", "--http-port", "0", "--api-key-file", str(keys)],
                   log_dir=tmp_path_factory.mktemp("http-logs"))
    c.extra_router += ["--metrics-port", "0"]
    with c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=KEY, max_retries=0)


def grpc_text(cluster, **kwargs) -> str:
    with cluster.channel(cluster.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return "".join(m.text for m in stub.Generate(generation_pb2.GenerateRequest(**kwargs), timeout=60))


def decode_load(cluster) -> internal_pb2.LoadReport:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["demo-v32"]


def test_completions_whole_and_streamed_equal_the_grpc_api(cluster, client):
    want = grpc_text(cluster, prompt=PROMPT, sampling_params=generation_pb2.SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))
    whole = client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # several prompts in one request (lm-eval batches this way)
    batch = client.completions.create(model="demo-v32", prompt=[PROMPT, "And God said"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 8


def test_chat_and_thinking_mode(cluster, client):
    messages = [{"role": "user", "content": "Who is the LORD?"}]
    want = grpc_text(cluster, messages=[generation_pb2.ChatMessage(role="user", content="Who is the LORD?")],
                     sampling_params=generation_pb2.SamplingParams(max_tokens=16, temperature=0.0))
    whole = client.chat.completions.create(model="demo-v32", messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == want.replace("<｜end▁of▁sentence｜>", "")
    streamed = client.chat.completions.create(model="demo-v32", messages=messages, max_completion_tokens=16,
                                              temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    # thinking: the reply up to </think> is reasoning_content, apart from content, whole and streamed
    kwargs = {"chat_template_kwargs": {"thinking": True}}
    thought = client.chat.completions.create(model="demo-v32", messages=messages, max_tokens=40, temperature=0,
                                             extra_body=kwargs)
    message = thought.choices[0].message
    with cluster.channel(cluster.address) as ch:  # the gRPC API splits the reply alike
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            messages=[generation_pb2.ChatMessage(role="user", content="Who is the LORD?")], thinking=True,
            sampling_params=generation_pb2.SamplingParams(max_tokens=40, temperature=0.0)), timeout=60))
    reasoning, answer = "".join(m.reasoning_text for m in msgs), "".join(m.text for m in msgs)
    assert reasoning and message.reasoning_content == reasoning and "</think>" not in (message.content or "")
    assert (message.content or "") == answer and "<｜end▁of▁sentence｜>" not in answer
    deltas = list(client.chat.completions.create(model="demo-v32", messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, extra_body=kwargs))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in deltas
                   if c.choices) == reasoning


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"model": "nope"}, 404, "model"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"presence_penalty": 5.0}, 400, "presence_penalty"),
    ({"logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ({"extra_body": {"min_tokens": 9}}, 400, "min_tokens"),
    ({"prompt": [99999]}, 400, "prompt_token_ids"),
    ({"max_tokens": 10**7}, 400, "max_tokens"),
    ({"max_tokens": 10**12}, 400, "max_tokens"),  # past int32: refused where parsed, not a 500
    ({"seed": 2**64}, 400, "seed"),
    ({"extra_body": {"priority": -(2**40)}}, 400, "priority"),
    ({"best_of": 3}, 400, "best_of"),
    ({"extra_body": {"cache_salt": "s" * 257}}, 400, "cache_salt"),
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, 400, "response_format.json_schema"),
])
def test_bad_requests_get_openai_errors_naming_the_field(client, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**{"model": "demo-v32", "prompt": "hi", "max_tokens": 4, **kwargs})
    assert err.value.status_code == status
    assert err.value.body["param"] == param and err.value.body["code"] == status


def test_cache_salt_keeps_tenants_prefixes_apart(cluster, client):
    """The same prompt with the same cache_salt finds its cached prefix; with another salt it finds none.
    A salt past 256 characters is INVALID_ARGUMENT over gRPC too."""
    prompt = " ".join(f"verse {i}" for i in range(40))  # ~100 tokens: several full blocks

    def cached(salt: str) -> int:
        out = client.completions.create(model="demo-v32", prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})
        assert out.usage.prompt_tokens >= 64
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    with cluster.channel(cluster.address) as ch, pytest.raises(grpc.RpcError) as err:
        list(generation_pb2_grpc.GenerationStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt=prompt, cache_salt="s" * 257), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


@pytest.mark.parametrize("path,body,field", [
    ("completions", '"prompt": "hi", "cache_salt": "a\\ud800"', "cache_salt"),
    ("completions", '"prompt": "hi \\udc00", "cache_salt": "a"', "prompt"),
    ("chat/completions", '"messages": [{"role": "user", "content": "x\\ud800"}]', "messages.0.content"),
    ("completions", '"prompt": "hi", "stop": ["ok", "\\udfff"]', "stop.1"),
])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_it(cluster, client, path, body, field):
    """JSON may carry "\\ud800" (no UTF-8 bytes): the body is refused naming the field, not a 500 at the proto."""
    raw = '{"model": "demo-v32", "max_tokens": 2, ' + body + "}"
    r = httpx.post(f"{client.base_url}{path}", content=raw, timeout=30,
                   headers={"content-type": "application/json", "authorization": f"Bearer {client.api_key}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "lone surrogate" in r.json()["error"]["message"]


def test_auth_overload_and_deadline(cluster, client):
    base = f"http://{cluster.http_address}/v1"
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"http://{cluster.http_address}/health").status_code == 200  # probes need no key
    with pytest.raises(openai.RateLimitError) as err:  # a TTFT target no instance can meet: refused at once
        client.completions.create(model="demo-v32", prompt="hi", max_tokens=4, extra_body={"sla": {"ttft_ms": 0.001}})
    assert int(err.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.APIStatusError) as err:  # its deadline passes before it starts
        client.completions.create(model="demo-v32", prompt="hi", max_tokens=4, extra_body={"timeout": 1e-6})
    assert err.value.status_code == 504


def test_a_client_that_disconnects_frees_its_kv(cluster):
    total = decode_load(cluster).total_blocks
    body = {"model": "demo-v32", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"http://{cluster.http_address}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert decode_load(cluster).free_blocks < total  # its KV is held while it streams
    assert wait_for(lambda: decode_load(cluster).free_blocks == total and decode_load(cluster).running == 0, 30)


def test_penalties_and_bias_through_http(cluster, client):
    """OpenAI's presence / frequency penalties and logit_bias, vLLM's repetition_penalty / min_p /
    min_tokens reach the engine's sampler: the same output as the engine's in-process with the same
    parameters."""
    llm = LLM(DEMO, enable_prefix_caching=False)
    ids = llm.engine.encode(PROMPT)
    for extra in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"logit_bias": {"42": 100}},
                  {"extra_body": {"repetition_penalty": 2.0}}, {"extra_body": {"min_tokens": 5, "min_p": 0.1}}):
        http = client.completions.create(model="demo-v32", prompt=ids, max_tokens=16, temperature=0, **extra)
        flat = {**extra.get("extra_body", {}), **{k: v for k, v in extra.items() if k != "extra_body"}}
        if "logit_bias" in flat:
            flat["logit_bias"] = {int(k): float(v) for k, v in flat["logit_bias"].items()}
        local = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, **flat))[0]
        assert http.choices[0].text == local.text, extra


def test_n_samples_with_a_seed_replay(client):
    kw = {"model": "demo-v32", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 24  # distinct samples, each counted


def test_logprobs_equal_the_engines_in_process(client):
    """Completions' `logprobs: N` and chat's `logprobs` / `top_logprobs`: each token's log-probability
    (the first one from the prefill instance, the rest from decode) equals the engine's in-process
    log-softmax of the model's raw logits, with the same top alternatives."""
    llm = LLM(DEMO, enable_prefix_caching=False)
    ids = llm.engine.encode(PROMPT)
    local = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))[0]
    http = client.completions.create(model="demo-v32", prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = http.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in local.logprobs], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs] == [3] * 6
    for top, want in zip(lp.top_logprobs, local.logprobs):
        assert sorted(top.values(), reverse=True) == pytest.approx(want.top_logprobs, abs=1e-5)
    assert "".join(lp.tokens) == http.choices[0].text
    chat = client.chat.completions.create(model="demo-v32", messages=[{"role": "user", "content": "Who?"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    streamed = client.completions.create(model="demo-v32", prompt=ids, max_tokens=6, temperature=0, logprobs=0,
                                         stream=True)
    values = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx([x.logprob for x in local.logprobs], abs=1e-5)


def test_echo_returns_the_prompt_and_its_logprobs(client):
    """`echo` with `logprobs` (what lm-eval's loglikelihood sends): the prompt's tokens and their
    log-probabilities (the first null) equal the engine's in-process prompt logprobs, then the completion's;
    max_tokens 0 returns the prompt alone; streamed alike (the prompt leads the first chunk)."""
    llm = LLM(DEMO, enable_prefix_caching=False)
    ids = llm.engine.encode(PROMPT)
    local = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2))[0]
    want = [None] + [x.logprob for x in local.prompt_logprobs[1:]] + [x.logprob for x in local.logprobs]
    http = client.completions.create(model="demo-v32", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = http.choices[0]
    echoed = llm.tokenizer.decode(ids, skip_special_tokens=False)  # token ids echo as their text, BOS included
    assert choice.text.startswith(echoed) and echoed.endswith(PROMPT) and len(choice.text) > len(echoed)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert "".join(choice.logprobs.tokens) == choice.text and choice.logprobs.text_offset[1] == len(
        choice.logprobs.tokens[0])
    only = client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=0,
                                     echo=True)
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[1:len(ids)], abs=1e-5)
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    chunks = [c for c in client.completions.create(model="demo-v32", prompt=ids, max_tokens=3, temperature=0,
                                                   logprobs=2, echo=True, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(want[1:], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as err:  # chat does not echo
        client.chat.completions.create(model="demo-v32", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})
    assert err.value.body["param"] == "echo"


def test_structured_outputs_through_both_endpoints(cluster, client):
    """OpenAI's response_format (json_schema strict, json_object), vLLM's structured_outputs and guided_*,
    and the gRPC API's structured_output: outputs match, streamed too; the first token (sampled by the
    prefill instance, handed to decode) is constrained as the rest; bad constraints get 400 naming the field."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model="demo-v32", messages=[{"role": "user", "content": "Who is the LORD?"}],
                                          max_tokens=80, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="demo-v32", messages=[{"role": "user", "content": "Who is the "
                                                                                      "LORD?"}],
                                              max_tokens=80, temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    obj = client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=80, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    digits = client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text) and digits.choices[0].finish_reason == "stop"
    pick = client.completions.create(model="demo-v32", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["light", "darkness"]})
    assert pick.choices[0].text in ("light", "darkness")
    constraint = generation_pb2.StructuredOutput(json_schema=json.dumps(schema))
    grpc_out = grpc_text(cluster, prompt=PROMPT, sampling_params=generation_pb2.SamplingParams(
        max_tokens=80, temperature=0.0, structured_output=constraint))
    jsonschema.validate(json.loads(grpc_out), schema)
    for kwargs, param in (({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bad"}}}},
                           "response_format"),
                          ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs.regex"),
                          ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
                           "guided_regex")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="demo-v32", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **kwargs)
        assert err.value.body["param"] == param


VERSE_TOOL = {"type": "function", "function": {
    "name": "get_verse", "description": "Look up a chapter",
    "parameters": {"type": "object", "properties": {"book": {"type": "string", "enum": ["Genesis", "Exodus"]},
                                                    "chapter": {"type": "integer", "minimum": 1, "maximum": 50}},
                   "required": ["book", "chapter"]}}}


def test_tool_call_round_trip(cluster, client):
    """tool_choice required / named: the grammar forces a DeepSeek-V3.2 tool call whose arguments validate
    against the function's schema, parsed back into OpenAI tool_calls (streamed as deltas too, and on the gRPC
    API); the call and the tool's result go back into the conversation and the model answers."""
    messages = [{"role": "user", "content": "Find Genesis chapter 1"}]
    call = client.chat.completions.create(model="demo-v32", messages=messages, tools=[VERSE_TOOL],
                                          tool_choice="required", max_tokens=200, temperature=0)
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [made] = choice.message.tool_calls
    assert made.function.name == "get_verse" and made.id.startswith("call_")
    jsonschema.validate(json.loads(made.function.arguments), VERSE_TOOL["function"]["parameters"])
    chunks = [c for c in client.chat.completions.create(
        model="demo-v32", messages=messages, tools=[VERSE_TOOL], max_tokens=200, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_verse"}}) if c.choices]
    pieces = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_verse"
    assert "".join(p.function.arguments or "" for p in pieces) == made.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with cluster.channel(cluster.address) as ch:
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            messages=[generation_pb2.ChatMessage(role="user", content="Find Genesis chapter 1")],
            tools=[generation_pb2.Tool(name="get_verse", parameters=json.dumps(VERSE_TOOL["function"]["parameters"]))],
            tool_choice="required", sampling_params=generation_pb2.SamplingParams(max_tokens=200, temperature=0.0)),
            timeout=60))
    assert "".join(d.arguments_delta for m in msgs for d in m.tool_calls) == made.function.arguments
    assert msgs[-1].finish_reason == "tool_calls"
    # (the demo model's 1,024-token context holds the tools' prompt or the history, not both)
    answer = client.chat.completions.create(model="demo-v32", max_tokens=16, temperature=0,
                                            messages=[*messages, choice.message.model_dump(exclude_none=True),
                                                      {"role": "tool", "tool_call_id": made.id,
                                                       "content": "In the beginning God created the heaven"}])
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    for kwargs, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                          ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**{"model": "demo-v32", "messages": messages, "tools": [VERSE_TOOL],
                                              "max_tokens": 4, **kwargs})
        assert err.value.body["param"] == param


def test_no_instance_up_is_503(tmp_path):
    """A router whose instances are all down holds a request for them within its deadline (pdserve's
    `timeout`), then answers 503 (and /health says so), not a hang or a 500."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "router", "--model", DEMO, "--port", "0", "--http-port", "0",
                             "--port-file", str(port_file), "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
                             "--insecure"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(port_file.exists, 60)
        http = f"127.0.0.1:{int(port_file.with_name('port.http').read_text())}"
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="demo-v32", prompt="hi", max_tokens=4, timeout=60,
                                      extra_body={"timeout": 2.0})
        assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"
        assert wait_for(lambda: httpx.get(f"http://{http}/health").status_code == 503, 30)
    finally:
        proc.terminate()
        proc.wait(30)


def test_n_streamed_samples_are_told_apart_by_index(client):
    kw = {"model": "demo-v32", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 11}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in whole.choices]  # the same seeded samples, streamed interleaved
    assert chunks[-1].usage.completion_tokens == 18


def test_http_calls_are_counted(cluster, client):
    client.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_ports[cluster.address]}/metrics").text
    assert 'pdserve_router_http_requests_total{route="/v1/models",status="200"}' in text
    assert 'pdserve_router_http_requests_total{route="/v1/completions",status="404"}' in text


FIRST_REQUEST_COSTS = """
import asyncio, sys
import fastapi.routing
from fastapi import FastAPI
from router.drain import DrainGate
from router.http import start_http

app = FastAPI()


@app.get("/x")
async def endpoint() -> dict:
    return {}


async def main():
    server, task, port = await start_http(DrainGate(app), "127.0.0.1", 0)
    print("anyio._backends._asyncio" in sys.modules, id(endpoint) in fastapi.routing._endpoint_context_cache)
    server.should_exit = True
    await task


asyncio.run(main())
"""


def test_the_http_server_pays_the_first_requests_costs_before_it_accepts_one():
    """anyio's lazily imported asyncio backend (~12 ms) and FastAPI's per-endpoint source read (~14 ms) were the
    first completion's through `pdserve up` (58-75 ms against 20-30 ms warm): both are done before the port opens
    (a fresh interpreter, so no other test loaded them)."""
    out = subprocess.run([sys.executable, "-c", FIRST_REQUEST_COSTS], capture_output=True, text=True, timeout=60,
                         check=True, cwd=Path(__file__).parents[1])
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
