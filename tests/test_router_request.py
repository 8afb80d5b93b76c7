"""The router's request seams without a cluster: a GenerateRequest validated once into a GenerationRequest
(the client's message untouched, what prefill and decode are sent built from the dataclass), finish reasons
mapped to the API's words in one place, and load reports read through the one LoadReport type."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.pools import Pool
from router.reply import api_finish_reason
from router.request import GenerationRequest, Invalid, RequestParser
from router.servicer import PeerFrameError, finish_of
from shared.protocol.finish import FinishReason
from shared.protocol.limits import RequestLimits
from shared.protocol.load import LoadReport, RankLoad
from shared.protocol.structured import ConstraintKind, StructuredOutput
from shared.rpc.convert import load_to_proto, sampling_from_proto, sampling_to_proto
from shared.rpc.pdserve.v1 import generation_pb2, internal_pb2, internal_pb2_grpc

CONTEXT = 64


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [3] * min(len(text), 8)


class _Constraints:
    def __init__(self) -> None:
        self.compiled: list[StructuredOutput] = []

    def matcher(self, constraint: StructuredOutput) -> None:
        self.compiled.append(constraint)


def _parse(request, open_ended: bool = False, constraints=None) -> GenerationRequest:
    parser = RequestParser(_Tokenizer(), RequestLimits(CONTEXT, 100), constraints or _Constraints(), 1 << 20, 16,
                           ThreadPoolExecutor(1))
    return asyncio.run(parser.parse(request, open_ended))


def test_a_request_is_parsed_once_and_the_client_s_message_is_left_alone():
    request = generation_pb2.GenerateRequest(
        request_id="a-1", prompt_token_ids=[5, 6, 7], priority=-1, sla=generation_pb2.Sla(ttft_ms=50.0),
        cache_salt="tenant-a", sampling_params=generation_pb2.SamplingParams(temperature=0.0, stop=["x"], seed=7))
    sent = request.SerializeToString()
    req = _parse(request, open_ended=True)
    assert request.SerializeToString() == sent
    assert (req.request_id, req.prompt_token_ids, req.priority, req.ttft_ms, req.tpot_ms) == ("a-1", (5, 6, 7), -1,
                                                                                              50.0, 0.0)
    assert req.cache_salt == "tenant-a"
    assert req.sampling.max_tokens == 16 and req.sampling.seed == 7 and req.sampling.stop == ["x"]
    assert sampling_from_proto(sampling_to_proto(req.sampling)) == req.sampling  # what prefill and decode see
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.priority = 0  # type: ignore[misc]


def test_a_forced_tool_call_and_thinking_shape_the_sampling_not_the_message():
    tool = generation_pb2.Tool(name="f", parameters='{"type": "object", "properties": {}}')
    request = generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="user", content="hi")],
                                             thinking=True, tools=[tool], tool_choice="required",
                                             sampling_params=generation_pb2.SamplingParams(max_tokens=4))
    sent = request.SerializeToString()
    constraints = _Constraints()
    req = _parse(request, constraints=constraints)
    assert request.SerializeToString() == sent
    structured = req.sampling.structured
    assert structured is not None and structured.kind is ConstraintKind.GRAMMAR and structured.after_reasoning
    assert constraints.compiled == [structured]
    assert req.sampling.skip_special_tokens is False
    assert req.reply.forced and req.reply.thinking and [t.name for t in req.reply.tools] == ["f"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"request_id": "bad id", "prompt_token_ids": [1]}, "request_id:"),
    ({"prompt_token_ids": [1], "prompt": "x"}, "exactly one of prompt, prompt_token_ids and messages"),
    ({"prompt_token_ids": [1], "sla": generation_pb2.Sla(ttft_ms=-1)}, "sla.ttft_ms:"),
    ({"prompt_token_ids": [1], "sampling_params": generation_pb2.SamplingParams(max_tokens=CONTEXT)},
     "sampling_params.max_tokens:"),
    ({"prompt_token_ids": [100]}, "prompt_token_ids: token id 100"),
    ({"prompt_token_ids": [1], "cache_salt": "s" * 257}, "cache_salt: at most 256"),
])
def test_an_invalid_field_is_named(kwargs, field):
    with pytest.raises(Invalid, match=f"^{field}"):
        _parse(generation_pb2.GenerateRequest(**kwargs))


def test_finish_reasons_become_the_api_s_words_in_one_place():
    assert api_finish_reason(None) == "" and api_finish_reason(None, called=True) == ""
    assert api_finish_reason(FinishReason.STOP) == "stop"
    assert api_finish_reason(FinishReason.STOP, called=True) == "tool_calls"
    assert api_finish_reason(FinishReason.LENGTH, called=True) == "length"
    assert api_finish_reason(FinishReason.ABORT) == "abort"


def test_a_decode_hop_s_unknown_finish_reason_fails_the_request_naming_the_field():
    assert finish_of(internal_pb2.DecodeResponse(finish_reason="length"), "d:1") is FinishReason.LENGTH
    assert finish_of(internal_pb2.DecodeResponse(), "d:1") is None
    with pytest.raises(PeerFrameError, match="d:1: finish_reason 'tool_calls; rm -rf' is not a finish reason"):
        finish_of(internal_pb2.DecodeResponse(finish_reason="tool_calls; rm -rf"), "d:1")


def test_load_reports_are_read_through_load_report():
    """Pool._poll's reading: a decode instance's ranks (reservations counted as running), a prefill's queue."""
    class Stub:
        def __init__(self, answer: internal_pb2.LoadReport):
            self.answer = answer

        async def GetLoad(self, request, timeout, metadata):
            return self.answer

    decode = LoadReport((RankLoad(0, running=2, free_blocks=9, active_leases=1, tokens=40),
                         RankLoad(1, running=0, free_blocks=4, queued_prompt_tokens=12)), block_size=16)
    prefill = LoadReport((RankLoad(0, queued_prompt_tokens=30),), block_size=32)

    async def run() -> tuple:
        pools = (Pool("decode", ["127.0.0.1:1"], internal_pb2_grpc.DecodeStub),
                 Pool("prefill", ["127.0.0.1:2"], internal_pb2_grpc.PrefillStub))
        for pool, report in zip(pools, (decode, prefill), strict=True):
            inst = pool.instances[0]
            inst.stub = Stub(load_to_proto(report))
            await pool._poll(inst, 0.25, ())
        return pools[0].instances[0].view, pools[1].instances[0].view

    dec, pre = asyncio.run(run())
    assert dec.up and [(r.running, r.tokens, r.prompt_tokens) for r in dec.ranks] == [(3, 40, 0), (0, 0, 12)]
    assert dec.free_blocks == 4 and dec.block_size == 16
    assert pre.up and pre.queued_tokens == 30 and pre.block_size == 32 and pre.kv_seq == 0
