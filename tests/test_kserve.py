"""KServe v2 / the Open Inference Protocol on `pdserve up --kserve-port 0` (the command, one cluster for the
module), driven by Triton's own client (`tritonclient`): health and metadata, whole and streamed text with the
same greedy tokens as the OpenAI and native gRPC APIs, several requests on one stream, and every bad tensor
answered INVALID_ARGUMENT naming the input (NOT_FOUND for another model)."""

from __future__ import annotations

import json
import queue

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from bench.fleet_faults import UpProcess
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

PROMPT = "In the beginning God created"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    proc = UpProcess(["--port", "0", "--http-port", "0", "--kserve-port", "0"], tmp_path_factory.mktemp("logs"))
    try:
        yield proc.start()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(up) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(up.kserve_address)


def tensor(name: str, datatype: str, value: object, shape: tuple[int, ...] = (1,)) -> triton.InferInput:
    t = triton.InferInput(name, list(shape), datatype)
    dtype = np.object_ if datatype == "BYTES" else (np.bool_ if datatype == "BOOL" else np.int32)
    t.set_data_from_numpy(np.array(value, dtype=dtype).reshape(shape))
    return t


def llm_inputs(prompt: str = PROMPT, stream: bool = False, params: dict | None = None, **flags: bool
               ) -> list[triton.InferInput]:
    inputs = [tensor("text_input", "BYTES", [prompt.encode()]), tensor("stream", "BOOL", [stream]),
              tensor("sampling_parameters", "BYTES", [json.dumps(params or GREEDY).encode()])]
    return inputs + [tensor(name, "BOOL", [value]) for name, value in flags.items()]


def native(up) -> tuple[list[int], str]:
    with grpc.insecure_channel(up.grpc_address) as ch:
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            prompt=PROMPT, sampling_params=generation_pb2.SamplingParams(**GREEDY)), timeout=60))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def streamed(client, requests: dict[str, list[triton.InferInput]], model: str) -> dict[str, list[str]]:
    """Each request's text_output parts, all sent on one stream (empty final responses asked for)."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for rid, inputs in requests.items():
            client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)
        parts: dict[str, list[str]] = {rid: [] for rid in requests}
        open_ = set(requests)
        while open_:
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                parts[response.id].append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                open_.discard(response.id)
        return parts
    finally:
        client.stop_stream()


def test_health_and_metadata(up, client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(up.model)
    assert not client.is_model_ready("another-model")
    assert client.get_server_metadata().name == "pdserve"
    meta = client.get_model_metadata(up.model)
    assert meta.name == up.model and meta.platform == "pdserve/deepseek_v32"
    assert {(t.name, t.datatype) for t in meta.inputs} >= {("text_input", "BYTES"), ("stream", "BOOL"),
                                                            ("sampling_parameters", "BYTES")}
    assert ("text_output", "BYTES") in {(t.name, t.datatype) for t in meta.outputs}


def test_same_greedy_text_as_the_openai_and_native_apis(up, client):
    ids, text = native(up)
    http = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)
    assert http.completions.create(model=up.model, prompt=PROMPT, **{k: v for k, v in GREEDY.items()
                                                                    if k != "ignore_eos"},
                                   extra_body={"ignore_eos": True}).choices[0].text == text
    whole = client.infer(up.model, llm_inputs(return_num_output_tokens=True, return_finish_reason=True))
    assert whole.as_numpy("text_output")[0].decode() == PROMPT + text  # the prompt first, as Triton's vLLM
    assert whole.as_numpy("num_output_tokens")[0] == len(ids) == 12
    assert whole.as_numpy("finish_reason")[0] == b"length"
    alone = client.infer(up.model, llm_inputs(exclude_input_in_output=True))
    assert alone.as_numpy("text_output")[0].decode() == text
    parts = streamed(client, {"a": llm_inputs(stream=True), "b": llm_inputs(stream=True, params={**GREEDY,
                                                                                                 "max_tokens": 3})},
                     up.model)
    assert "".join(parts["a"]) == text and len(parts["a"]) > 1  # token by token
    assert "".join(parts["b"]) and text.startswith("".join(parts["b"])) and len("".join(parts["b"])) < len(text)


BAD = [  # (inputs, the error's words): each answered INVALID_ARGUMENT naming the input
    ([tensor("text_input", "INT32", [1])], "input 'text_input': datatype INT32, expected BYTES"),
    ([tensor("text_input", "BYTES", [b"a", b"b"], (2,))], "input 'text_input': shape [2] is not one element"),
    ([tensor("stream", "BOOL", [False])], "input 'text_input': missing"),
    ([tensor("text_input", "BYTES", [b"hi"]), tensor("sampling_parameters", "BYTES", [b"{max_tokens"])],
     "input 'sampling_parameters': not valid JSON"),
    ([tensor("text_input", "BYTES", [b"hi"]), tensor("sampling_parameters", "BYTES", [b"[1]"])],
     "input 'sampling_parameters': a JSON object is expected"),
    ([tensor("text_input", "BYTES", [b"hi"]), tensor("sampling_parameters", "BYTES", [b'{"temperature": -1}'])],
     "sampling_parameters.temperature"),
    ([tensor("text_input", "BYTES", [b"hi"]), tensor("image", "BYTES", [b"x"])], "input 'image': not an input"),
    ([tensor("text_input", "BYTES", [b"\xff\xfe"])], "input 'text_input': not UTF-8"),
    ([tensor("text_input", "BYTES", [b"hi"]), tensor("stream", "BOOL", [True])], "needs ModelStreamInfer"),
]


@pytest.mark.parametrize("inputs,words", BAD)
def test_bad_tensors_are_invalid_argument_naming_the_input(up, client, inputs, words):
    with pytest.raises(InferenceServerException) as err:
        client.infer(up.model, inputs)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and words in err.value.message()


def test_another_model_is_not_found_and_raw_garbage_is_invalid(up, client):
    with pytest.raises(InferenceServerException) as err:
        client.infer("another-model", llm_inputs())
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with grpc.insecure_channel(up.kserve_address) as ch:  # the protocol's own messages, hostile raw contents
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        req = service_pb2.ModelInferRequest(model_name=up.model, raw_input_contents=[b"\x10\x00\x00\x00abc"])
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        with pytest.raises(grpc.RpcError) as rpc:
            stub.ModelInfer(req, timeout=10)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "runs past the contents" in rpc.value.details()


def test_a_bad_request_on_a_stream_fails_alone(up, client):
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(up.model, [tensor("text_input", "INT32", [1])], request_id="bad")
        client.async_stream_infer(up.model, llm_inputs(), request_id="good")
        seen = [results.get(timeout=60) for _ in range(2)]
    finally:
        client.stop_stream()
    errors = [e for _, e in seen if e is not None]
    goods = [r for r, e in seen if e is None]
    assert len(errors) == 1 and "INVALID_ARGUMENT: input 'text_input'" in str(errors[0])
    assert len(goods) == 1 and goods[0].as_numpy("text_output")[0].decode().startswith(PROMPT)
