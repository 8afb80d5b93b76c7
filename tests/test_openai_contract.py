"""OpenAI's contract on the router's HTTP API where it used to differ, through the official `openai` SDK (raw
HTTP where the SDK cannot send it), against one cluster for the module (the demo model: its 1,024-token
context holds the tools' prompt, which the 512-token test checkpoint does not): completions default to 16
tokens; usage counts each prompt once; the `n` samples of a prompt share one prefill; a failed sample or
prompt cancels its siblings; OpenAI's error body on every route and status; the `developer` role; streamed
lists of prompts; parallel_tool_calls; Retry-After on every 429; the body and prompt-count limits; no piece
of a DSML tag in a forced call cut by max_tokens."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from router.cluster import Cluster
from router.config import MAX_BODY_BYTES, MAX_PROMPTS
from router.http import OpenAIFrontDoor
from router.openai_fanout import PREFIX_VIEW_WAIT_S, PrefixWatch, all_or_none
from router.openai_limits import COMPLETION_MAX_TOKENS
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from tests.helpers import wait_for

DEMO = "models/demo-v32"
MODEL = "demo-v32"
PROMPT = "In the beginning God created"
MAX_IN_FLIGHT = 12  # the router's --max-concurrent-requests here
BLOCK = 16  # the prefill's KV block size (its default)
ERROR_KEYS = {"message", "type", "param", "code"}
# A short tool (the tools' prompt is ~700 of the context's 1,024 tokens): one call of it is ~95 tokens
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"b": {"type": "string", "enum": ["x"]}}, "required": ["b"]}}}
FORCED = {"type": "function", "function": {"name": "f"}}
SLASH = 20  # the demo tokenizer's "/": biased away, a forced call's block never closes (call after call)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(DEMO, dtype="float32", log_dir=tmp_path_factory.mktemp("openai-logs"),
                 # every prompt through the prefill instance: test_n_samples_share_one_prefill keeps it busy on
                 # purpose (a burst's overflow to decode, on by default, is tests/test_selective.py's)
                 extra_router=["--http-port", "0", "--metrics-port", "0", "--max-concurrent-requests",
                               str(MAX_IN_FLIGHT), "--overflow-prefill-tokens", "0"],
                 extra_prefill=["--metrics-port", "0"], extra_decode=["--metrics-port", "0"]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0)


def counter(cluster, address: str, name: str, **labels: str) -> float:
    """A sample of a service's /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_ports[address]}/metrics", timeout=10).text
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m[1] or "")) == labels:
            return float(m[2])
    return 0.0


def in_flight(cluster) -> float:
    return counter(cluster, cluster.address, "pdserve_router_in_flight_requests")


def decode_running(cluster) -> int:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5).running


def prefill_computed(cluster) -> float:
    """Prompt tokens the prefill instance computed so far (prefilled less served from its prefix cache)."""
    pre = cluster.prefill_addrs[0]
    return counter(cluster, pre, "pdserve_tokens_total", service="prefill", kind="prompt") - \
        counter(cluster, pre, "pdserve_tokens_total", service="prefill", kind="cached_prompt")


def raw(cluster, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"http://{cluster.http_address}{path}", timeout=120, **kwargs)


def sse(cluster, body: dict) -> list[str]:
    """A streamed request's `data:` payloads, raw."""
    with httpx.stream("POST", f"http://{cluster.http_address}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_completions_default_to_16_tokens_chat_keeps_its_own(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == COMPLETION_MAX_TOKENS == 16 and whole.choices[0].finish_reason == "length"
    # chat without max_tokens runs past 16 (--chat-max-tokens): read 24 tokens, then leave (the request is cancelled)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who?"}],
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    pieces = 0
    for chunk in stream:
        pieces += bool(chunk.choices and chunk.choices[0].delta.content)
        if pieces > 24:
            break
    stream.close()
    assert pieces > 24


def test_usage_counts_each_prompt_once(client):
    five, seven = [5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]
    out = client.completions.create(model=MODEL, prompt=five, n=3, max_tokens=2, temperature=1.0, seed=3)
    assert len(out.choices) == 3 and out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 6
    assert out.usage.total_tokens == 11
    two = client.completions.create(model=MODEL, prompt=[five, seven], n=2, max_tokens=2, temperature=0)
    assert two.usage.prompt_tokens == 12 and two.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=[five, seven], n=2, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == 12 and chunks[-1].usage.completion_tokens == 8


def test_n_samples_share_one_prefill(cluster, client):
    """An n=8 request computes its prompt once: samples 1..7 start after sample 0's first token and find the
    prompt's full blocks in the prefill's prefix cache, each computing only the tail past its last full block.
    The prefill is kept busy meanwhile (three 900-token prompts just before): samples sent together would
    wait behind them and then be computed side by side, 8 times."""
    n, length = 8, 200
    rng = random.Random(44)  # prompts no other test sends: nothing of them is cached
    prompt = rng.choices(range(10, 4000), k=length)
    blockers = [rng.choices(range(10, 4000), k=900) for _ in range(3)]
    before = prefill_computed(cluster)
    busy = [threading.Thread(target=client.completions.create, kwargs={
        "model": MODEL, "prompt": p, "max_tokens": 1}) for p in blockers]
    for t in busy:
        t.start()
    time.sleep(0.05)
    out = client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=4, temperature=1.0, seed=5)
    for t in busy:
        t.join(60)
    assert wait_for(lambda: prefill_computed(cluster) >= before + 3 * 900 + length, 10)
    computed = prefill_computed(cluster) - before - 3 * 900
    print(f"\nprefill computed {computed:.0f} prompt tokens for one n={n} request of a {length}-token prompt "
          f"(n × prompt = {n * length})")
    assert len(out.choices) == n and out.usage.prompt_tokens == length
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # sample 0 computed it
    assert computed <= length + (n - 1) * BLOCK


def test_a_failed_prompt_cancels_its_siblings(cluster, client):
    """A list of prompts, one of them refused downstream (a token id outside the vocabulary, found by the
    router's validation while the other one is admitted): the 400 comes back and the other prompt's
    request is cancelled, not left to generate ~1,000 tokens nobody reads."""
    assert wait_for(lambda: in_flight(cluster) == 0, 30)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [99999]], max_tokens=1000, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert err.value.body["param"] == "prompt_token_ids"
    assert wait_for(lambda: in_flight(cluster) == 0, 1.0)
    time.sleep(1.0)  # nothing starts later either
    assert in_flight(cluster) == 0 and decode_running(cluster) == 0


def test_a_refused_sample_cancels_its_siblings_and_every_429_says_when_to_retry(cluster, client):
    """8 streams held open; an n=5 request then passes --max-concurrent-requests (12) at its 5th sample:
    429 with Retry-After (the router's concurrency limit has no estimate of its own), and its 4 admitted
    samples are cancelled (the router holds the 8 streams only)."""
    assert wait_for(lambda: in_flight(cluster) == 0, 30)
    body = {"model": MODEL, "prompt": PROMPT, "n": 8, "max_tokens": 900, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://{cluster.http_address}/v1/completions", json=body, timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(line for line in lines if line.startswith("data: "))
        assert in_flight(cluster) == 8
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT, n=5, max_tokens=900, temperature=1.0,
                                      extra_body={"ignore_eos": True})
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert set(err.value.body) == ERROR_KEYS and err.value.body["code"] == 429
        assert wait_for(lambda: in_flight(cluster) == 8, 1.0)
        time.sleep(1.0)
        assert in_flight(cluster) == 8
    assert wait_for(lambda: in_flight(cluster) == 0, 10)  # the held stream, closed, is cancelled too


def test_every_route_and_status_answers_openai_errors(cluster, client):
    with pytest.raises(openai.NotFoundError) as err:  # a route this server does not have, through the SDK
        client.embeddings.create(model=MODEL, input="hi")
    assert set(err.value.body) == ERROR_KEYS and err.value.body["code"] == 404
    cases = [("GET", "/nope", {}, 404), ("GET", "/v1/completions", {}, 405), ("DELETE", "/v1/models", {}, 405),
             ("POST", "/v1/completions", {"content": b'{"model": "demo-v32", "prompt": ',
                                          "headers": {"content-type": "application/json"}}, 400),
             ("POST", "/v1/chat/completions", {"content": b"not json at all"}, 400),
             ("POST", "/v1/completions", {"json": [1, 2]}, 400),
             ("POST", "/v1/completions", {"json": {"model": "nope", "prompt": "hi"}}, 404),
             ("GET", "/v1/models/nope", {}, 404)]
    for method, path, kwargs, status in cases:
        response = raw(cluster, method, path, **kwargs)
        assert response.status_code == status, (method, path)
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == status and error["message"], (method, path, error)
    assert "POST" in raw(cluster, "GET", "/v1/chat/completions").headers["allow"]


def test_developer_role_is_the_system_prompt(client):
    def reply(role: str) -> str:
        out = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
            {"role": role, "content": "Answer in the words of Genesis."}, {"role": "user", "content": "Who?"}])
        return out.choices[0].message.content

    assert reply("developer") == reply("system")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "boss", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"


def test_a_streamed_list_of_prompts(cluster, client):
    """choices index = prompt index × n + sample index, each the same text as the whole response's; one [DONE]."""
    kw = {"model": MODEL, "prompt": [PROMPT, "And God said"], "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 9}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in whole.choices]
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    events = sse(cluster, {**kw, "stream": True})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert {json.loads(e)["choices"][0]["index"] for e in events[:-1]} == {0, 1, 2, 3}


def test_body_and_prompt_count_limits(cluster, client):
    big = raw(cluster, "POST", "/v1/completions", content=json.dumps(
        {"model": MODEL, "prompt": "a" * (MAX_BODY_BYTES + 1)}).encode(), headers={"content-type": "application/json"})
    assert big.status_code == 413 and set(big.json()["error"]) == ERROR_KEYS
    with pytest.raises(openai.BadRequestError) as err:  # 10,000 prompts, streamed or not
        client.completions.create(model=MODEL, prompt=["hi"] * 10_000, max_tokens=1)
    assert err.value.body["param"] == "prompt" and str(MAX_PROMPTS) in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[[5]] * 10_000, max_tokens=1, stream=True)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # more requests than the router ever runs at once
        client.completions.create(model=MODEL, prompt=["hi"] * 4, n=4, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    # a 128k-token prompt (about 1 MB of JSON) passes the body limit: the model's context refuses it
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[129_279] * 131_072, max_tokens=1)
    assert err.value.body["param"] == "prompt_token_ids"


def calls_of(client, stream: bool, **kwargs) -> tuple[str, list[dict]]:
    """(content, tool calls) of a forced call of f, whole or gathered from its stream."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "tools": [TOOL],
          "tool_choice": FORCED, "temperature": 0, **kwargs}
    if not stream:
        message = client.chat.completions.create(**kw).choices[0].message
        return message.content or "", [c.model_dump() for c in message.tool_calls or ()]
    content, calls = "", {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        for d in (delta.tool_calls or ()) if delta else ():
            call = calls.setdefault(d.index, {"function": {"name": "", "arguments": ""}})
            call["function"]["name"] += d.function.name or ""
            call["function"]["arguments"] += d.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """"/" biased away: the forced block never closes and the model calls f again and again; with
    parallel_tool_calls false only the first call comes back, whole and streamed."""
    kw = {"max_tokens": 250, "logit_bias": {str(SLASH): -100}}
    _, several = calls_of(client, False, **kw)
    assert len(several) >= 2
    for stream in (False, True):
        content, calls = calls_of(client, stream, parallel_tool_calls=False, **kw)
        assert len(calls) == 1 and calls[0]["function"]["arguments"] == several[0]["function"]["arguments"]
        assert content == ""


@pytest.fixture(scope="module")
def cuts(client) -> list[int]:
    """Where to cut the forced call: every 6th of its tokens (inside each tag), and 1, 2 and 8 tokens into the
    closing tag after its value (`x<`, `x</`, `x</｜DSML`), found from the whole call's tokens."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], tools=[TOOL],
                                         tool_choice=FORCED, temperature=0, max_tokens=200, logprobs=True)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    texts = list(itertools.accumulate(t.token for t in out.choices[0].logprobs.content))
    value = next(i for i, text in enumerate(texts, 1) if text.endswith('">x'))
    return sorted({*range(1, len(texts), 6), value + 1, value + 2, value + 8})


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_leaks_no_tag(client, cuts, stream):
    """No `<` in content, no piece of a DSML tag in the arguments, which always parse, wherever max_tokens cuts.
    The cuts are asked at once (greedy tokens do not depend on their neighbours in a batch)."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda n: calls_of(client, stream, max_tokens=n), cuts))
    for max_tokens, (content, calls) in zip(cuts, answers):
        assert "<" not in content and "｜" not in content, (max_tokens, content)
        for call in calls:
            args = call["function"]["arguments"]
            assert "<" not in args and "｜" not in args and "DSML" not in args, (max_tokens, args)
            assert json.loads(args) in ({}, {"b": ""}, {"b": "x"}), (max_tokens, args)


def test_concurrent_whole_requests_share_nothing_but_the_cluster(cluster, client):
    """Several n>1 requests at once (each prompt's samples staged behind its own first token) all complete."""
    results: list[int] = []

    def ask(i: int) -> None:
        out = client.completions.create(model=MODEL, prompt=[7 + i, 8, 9, 10], n=3, max_tokens=3, temperature=1.0)
        results.append(len(out.choices))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [3, 3, 3]


# --- without a cluster: the front door over a stand-in servicer -------------------------------------------


class _Servicer:
    """What OpenAIFrontDoor uses of router.server.GenerationServicer; its generate fails or sleeps."""

    def __init__(self, fail: bool):
        self.fail, self.started, self.cancelled = fail, 0, 0
        self.cfg = types.SimpleNamespace(max_concurrent_requests=64)
        self.limits = types.SimpleNamespace(context_tokens=1024)
        self.prefill = self.decode = types.SimpleNamespace(instances=[])
        self.tokenizer = None

    async def generate(self, req, call, open_ended=False):
        self.started += 1
        if self.fail:
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield  # an async generator


def _asgi(front: OpenAIFrontDoor) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app, raise_app_exceptions=False),
                             base_url="http://pdserve")


def test_an_unexpected_error_is_a_500_in_openai_s_body():
    async def main() -> httpx.Response:
        async with _asgi(OpenAIFrontDoor(_Servicer(fail=True), MODEL, [])) as http:
            return await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})

    response = asyncio.run(main())
    assert response.status_code == 500 and set(response.json()["error"]) == ERROR_KEYS


def test_a_chunked_body_past_the_limit_is_413():
    async def chunks():
        for _ in range(10):
            yield b"x" * 200

    async def main() -> httpx.Response:
        async with _asgi(OpenAIFrontDoor(_Servicer(fail=False), MODEL, [], max_body_bytes=1000)) as http:
            return await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})

    response = asyncio.run(main())
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_the_first_failure_cancels_the_rest():
    cancelled = []

    async def slow(i: int) -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def fails() -> int:
        await asyncio.sleep(0.01)
        raise ValueError("one prompt failed")

    async def main() -> None:
        with pytest.raises(ValueError):
            await asyncio.wait_for(all_or_none([slow(0), fails(), slow(2)]), 5)

    asyncio.run(main())
    assert sorted(cancelled) == [0, 2]


def test_samples_wait_for_the_view_of_the_prefix_with_several_prefills():
    def instances(*seqs: int):
        return [types.SimpleNamespace(view=types.SimpleNamespace(up=True, kv_seq=n)) for n in seqs]

    async def main() -> tuple[float, float, float]:
        one = PrefixWatch(lambda: instances(0))
        t0 = time.monotonic()
        await one.settled(10.0)  # one prefill: every sample goes there anyway
        alone = time.monotonic() - t0
        pools = instances(0, 0)
        two = PrefixWatch(lambda: pools)
        t0 = time.monotonic()
        await two.settled(0.3)  # no change: at most what recomputing would cost
        unchanged = time.monotonic() - t0
        three = PrefixWatch(lambda: pools)
        asyncio.get_running_loop().call_later(0.1, lambda: setattr(pools[1].view, "kv_seq", 1))
        t0 = time.monotonic()
        await three.settled(10.0)
        return alone, unchanged, time.monotonic() - t0

    alone, unchanged, changed = asyncio.run(main())
    assert alone < 0.05 and 0.3 <= unchanged < 0.6 and 0.1 <= changed < PREFIX_VIEW_WAIT_S
