"""The Gateway API Inference Extension's endpoint picker on `pdserve up --epp-port 0` (the command; one prefill
and two decode instances, one cluster for the module), driven as Envoy drives it: the ext_proc stream with
Envoy's own protos (xds-protos). It names the router endpoint in the header and the envoy.lb metadata, places
the request as the router does (the decode instance holding the prompt's prefix), honours the proxy's subset,
refuses what no pair can serve (429) or what has nowhere to go (503), and the router it names follows its pair.
What could not run here: an Envoy proxy or a Kubernetes Gateway in front of it (none on this machine)."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from google.protobuf import struct_pb2

from bench.fleet_faults import UpProcess

Mode = processing_mode_pb2.ProcessingMode
DESTINATION = "x-gateway-destination-endpoint"
LONG = "And God said, Let there be light: and there was light. " * 12  # a prefix of several KV blocks
OTHER = "And the evening and the morning were the first day. " * 12


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    proc = UpProcess(["--port", "0", "--http-port", "0", "--epp-port", "0", "--num-decode", "2"],
                     tmp_path_factory.mktemp("logs"))
    try:
        yield proc.start()
    finally:
        proc.stop()


def router_endpoint(up) -> str:
    return up.http_url.removeprefix("http://").removesuffix("/v1")


def converse(up, body: bytes | None, mode: int = Mode.FULL_DUPLEX_STREAMED, subset: list[str] | None = None,
             path: str = "/v1/completions") -> list[ext.ProcessingResponse]:
    """One HTTP request's ext_proc stream as Envoy sends it: headers, then the body in two chunks."""
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
                                          base_pb2.HeaderValue(key=":method", raw_value=b"POST")])
    first = ext.ProcessingRequest(request_headers=ext.HttpHeaders(headers=headers, end_of_stream=body is None),
                                  protocol_config=ext.ProtocolConfiguration(request_body_mode=mode,
                                                                            response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    messages = [first]
    if body is not None:  # in chunks, as Envoy streams it: 7 bytes, then up to 1 MiB each
        cuts = [0, *range(7, len(body), 1 << 20), len(body)]
        messages += [ext.ProcessingRequest(request_body=ext.HttpBody(body=body[a:b], end_of_stream=b == len(body)))
                     for a, b in zip(cuts, cuts[1:])]
    if mode == Mode.BUFFERED and body is not None:  # Envoy buffers the body: one message
        messages[1:] = [ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True))]
    with grpc.insecure_channel(up.epp_address) as ch:
        return list(ext_grpc.ExternalProcessorStub(ch).Process(iter(messages), timeout=30))


def mutation(response: ext.ProcessingResponse) -> dict[str, str]:
    phase = response.WhichOneof("response")
    common = getattr(response, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def completion(up, prompt: str) -> bytes:
    return json.dumps({"model": up.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()


def pairs_served(up) -> dict[str, float]:
    """pdserve_router_pairs_total per decode instance."""
    text = urllib.request.urlopen(up.metrics["router"], timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_pairs_total{"):
            decode = line.split('decode="')[1].split('"')[0]
            out[decode] = out.get(decode, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def served_on(up, prompt: str, headers: dict[str, str] | None = None) -> str:
    """The decode instance the router served `prompt` on."""
    before = pairs_served(up)
    r = httpx.post(f"{up.http_url}/completions", content=completion(up, prompt), timeout=60,
                   headers={"content-type": "application/json", **(headers or {})})
    assert r.status_code == 200, r.text
    after = pairs_served(up)
    (decode,) = [d for d in after if after[d] != before.get(d, 0.0)]
    return decode


def test_full_duplex_names_the_router_and_places_like_it(up):
    home = served_on(up, LONG + "Amen.")  # that decode instance now caches the prompt's prefix
    other = next(d for d in up.pools["decode"] if d != home)
    hint = {"x-pdserve-prefill": up.pools["prefill"][0], "x-pdserve-decode": other}
    assert served_on(up, OTHER + "Amen.", hint) == other  # and the other one another prompt's
    time.sleep(1.0)  # their KV events and load reports reach the router's views
    (answer, _) = converse(up, completion(up, OTHER + "Selah."))
    assert mutation(answer)["x-pdserve-decode"] == other
    headers_answer, body_answer = converse(up, completion(up, LONG + "Selah."))
    picked = mutation(headers_answer)
    assert picked[DESTINATION] == router_endpoint(up)
    lb = headers_answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
    assert lb == picked[DESTINATION]  # the header and the metadata agree, as the protocol requires
    assert picked["x-pdserve-decode"] == home and picked["x-pdserve-prefill"] == up.pools["prefill"][0]
    streamed = body_answer.request_body.response.body_mutation.streamed_response
    assert streamed.body == completion(up, LONG + "Selah.") and streamed.end_of_stream  # sent back whole
    time.sleep(1.0)
    assert served_on(up, LONG + "Selah!") == home  # the router, asked alone, chooses the same decode


def test_the_router_follows_the_pair_it_is_handed(up):
    before = up.metric("router", 'pdserve_router_epp_hints_total{outcome="followed"}')
    other = [d for d in up.pools["decode"]][1]
    hint = {"x-pdserve-prefill": up.pools["prefill"][0], "x-pdserve-decode": other}
    assert served_on(up, "In the beginning", hint) == other
    assert up.metric("router", 'pdserve_router_epp_hints_total{outcome="followed"}') == before + 1
    hostile = {"x-pdserve-prefill": "10.9.9.9:1", "x-pdserve-decode": "evil"}  # not a pair it admits: ignored
    assert served_on(up, "In the beginning", hostile) in up.pools["decode"]
    assert up.metric("router", 'pdserve_router_epp_hints_total{outcome="not_admitted"}') >= 1


def test_buffered_mode_and_a_body_it_cannot_place(up):
    headers_answer, body_answer = converse(up, completion(up, "In the beginning"), mode=Mode.BUFFERED)
    assert headers_answer.WhichOneof("response") == "request_headers" and not mutation(headers_answer)
    assert mutation(body_answer)[DESTINATION] == router_endpoint(up)  # rides on the body's answer
    (answer, _) = converse(up, b"{not json")  # still routed (the router answers the 400), with no pair
    assert mutation(answer) == {DESTINATION: router_endpoint(up)}
    (answer,) = converse(up, None, path="/v1/models")  # no body: picked on the headers
    assert mutation(answer)[DESTINATION] == router_endpoint(up)
    (huge,) = converse(up, b"x" * (33 << 20))  # past the router's --http-max-body-bytes: refused, not held
    assert huge.immediate_response.status.code == 413


def test_subset_and_refusals(up):
    (answer, _) = converse(up, completion(up, "In the beginning"), subset=["10.0.0.7:8000", "10.0.0.8:8000"])
    assert mutation(answer)[DESTINATION].split(",")[0] in ("10.0.0.7:8000", "10.0.0.8:8000")
    assert set(mutation(answer)[DESTINATION].split(",")) == {"10.0.0.7:8000", "10.0.0.8:8000"}  # the fallbacks
    (empty,) = converse(up, completion(up, "In the beginning"), subset=[])
    assert empty.immediate_response.status.code == 503
    body = json.dumps({"model": up.model, "prompt": "In the beginning", "max_tokens": 4,
                       "sla": {"ttft_ms": 0.001}}).encode()  # no pair can answer within a microsecond
    (refused,) = converse(up, body)
    assert refused.immediate_response.status.code == 429
    assert json.loads(refused.immediate_response.body)["error"]["code"] == 429
    assert any(h.header.key == "retry-after" for h in refused.immediate_response.headers.set_headers)
