"""The router: public `pdserve.v1.Generation/Generate`, relaying one request through
decode.Reserve → prefill.Prefill (KV pushed to the reservation) → decode.Decode (token stream).

    python -m router --model DIR --prefill HOST:PORT[,HOST:PORT...] --decode HOST:PORT[,...]
                     [--host 127.0.0.1] [--port 50051] [--metrics-port N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.autoscale import (
    AUTOSCALE_TPOT_MS,
    AUTOSCALE_TTFT_MS,
    AutoscaleConfig,
    Autoscaler,
    Bounds,
    FleetLoad,
    Target,
    observe,
    prometheus_query,
    read_counters,
)
from router.drain import DRAINING_MESSAGE, RETRY_AFTER_S, DrainGate
from router.http import OpenAIFrontDoor, read_api_keys, start_http
from router.openai_limits import MAX_BODY_BYTES, MAX_PROMPTS
from router.perf import PerfModel
from router.policy import POLICIES, DecodeView, PrefillView, RankView, Rejected, Request
from router.reply import ReplyParser
from shared import metrics
from shared.config import REQUIRED, EndpointConfig, ModelConfig, check_bounds, flag, flag_name, parse_flags, same_as
from shared.protocol.chat import ChatMessage, render_messages
from shared.protocol.limits import RequestLimits
from shared.protocol.prefix import PrefixFilter, prompt_block_hashes
from shared.protocol.sampling import SamplingParams
from shared.protocol.structured import ConstraintCompiler, ConstraintKind, StructuredOutput
from shared.protocol.tokenizer import Tokenizer
from shared.protocol.tools import ToolCall, ToolFunction, tool_call_grammar
from shared.rpc.convert import sampling_from_proto
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.rpc.service import (
    Credentials,
    Lifecycle,
    aio_channel,
    die_with_launcher,
    start_server,
    write_port_file,
)

log = logging.getLogger("pdserve.router")
SERVICE = "pdserve.v1.Generation"
# Fail fast on a dead peer instead of waiting for reconnect back-off.
PEER_TIMEOUT = 10.0
# A down instance is polled again after interval × 2^failures, at most this long: an instance that comes
# back (a restart, a rolling upgrade) takes requests within about this many seconds.
MAX_POLL_BACKOFF = 2.0


@dataclass(kw_only=True)
class RouterConfig(EndpointConfig):
    model: str = flag(REQUIRED, "checkpoint directory (config.json + tokenizer.json are read)")
    prefill: list[str] = flag(REQUIRED, "comma-separated prefill instance addresses (dns:NAME:PORT: every "
                                        "address NAME resolves to, e.g. a Kubernetes headless service)")
    decode: list[str] = flag(REQUIRED, "comma-separated decode instance addresses (dns:NAME:PORT as for --prefill)")
    port: int = flag(50051, "public gRPC port (0 = pick a free one, reported with --port-file)")
    request_timeout: float = flag(600.0, "longest a Generate call may run, in seconds")
    drain_seconds: float = flag(30.0, "on SIGTERM: readiness off, new requests refused (HTTP 503 + Retry-After, gRPC "
                                      "UNAVAILABLE), the HTTP and gRPC streams in flight get this long to finish, "
                                      "then the process exits (Kubernetes' default grace period is 30 s)",
                                bounds=(0, None))
    instance_wait: float = flag(10.0, "longest a request waits, within its deadline, for a prefill and a decode "
                                      "instance to be reachable (starting, reconnecting, restarting) before it "
                                      "fails with UNAVAILABLE, in seconds", bounds=(0, None))
    max_prompt_bytes: int = flag(0, "largest text prompt / messages accepted (0: 32 bytes per context token, "
                                    "at most 8 MiB)")
    max_concurrent_requests: int = flag(1024, "Generate calls in flight beyond this get RESOURCE_EXHAUSTED at once")
    policy: str = flag("sla", "how a (prefill, decode) pair is chosen", choices=tuple(POLICIES))
    ttft_slo_ms: float = flag(0.0, "time-to-first-token target (0: none); a request no pair can serve within "
                                   "its targets is refused at once with RESOURCE_EXHAUSTED")
    tpot_slo_ms: float = flag(0.0, "time-per-output-token target (0: none)")
    local_prefill_tokens: int = flag(0, "selective disaggregation: a prompt of at most this many tokens is "
                                        "prefilled on the decode instance itself (chunked within its token "
                                        "budget, beside its running decodes) when the SLA model predicts its "
                                        "first token sooner there than through a prefill instance (sla policy; "
                                        "0: every prompt goes to a prefill instance)", bounds=(0, None))
    admission_wait_ms: float = flag(0.0, "instead of refusing at once, hold a request no pair can serve yet for up "
                                         "to this long, re-choosing as load reports arrive, while it can still "
                                         "make its TTFT target (0: refuse at once)")
    profile: str | None = flag(None, "profile.json from `pdserve profile` (default: built-in estimates, "
                                     "calibrated online either way)")
    migration_limit: int = flag(3, "times one request may move to another instance when the one serving it fails "
                                   "(decode killed, connection lost, drain): the stream goes on from the tokens "
                                   "already sent; past the limit the request fails with UNAVAILABLE",
                                bounds=(0, None))
    autoscale: str | None = same_as(AutoscaleConfig, "autoscale")
    autoscale_period: float = same_as(AutoscaleConfig, "autoscale_period")
    autoscale_down_after: float = same_as(AutoscaleConfig, "autoscale_down_after")
    autoscale_headroom: float = same_as(AutoscaleConfig, "autoscale_headroom")
    autoscale_window: float = same_as(AutoscaleConfig, "autoscale_window")
    autoscale_prometheus: str | None = flag(None, "several routers: size the pools for all their load, every "
                                                  "router's counters summed over --autoscale-window by the "
                                                  "Prometheus at this base URL (the routers then decide alike); "
                                                  "unset, or while it cannot be read: this router's own counters")
    autoscale_routers: str = flag("", "with --autoscale-prometheus: PromQL label matchers of every router of this "
                                      "deployment, e.g. namespace=\"ml\",pod=~\"pdserve-router-.+\"")
    decode_dp: int = flag(1, "DP ranks of each decode instance (their --dp): --autoscale plans an instance as "
                             "that many ranks' batches", bounds=(1, None))
    load_interval: float = flag(0.25, "seconds between load reports polled from each instance")
    discovery_interval: float = flag(5.0, "seconds between DNS resolutions of dns:NAME:PORT instance addresses")
    http_port: int | None = flag(None, "also serve the OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health) on this port (0: a free one, "
                                       "reported in PORT_FILE.http); TLS with --tls-cert/--tls-key when given",
                                 bounds=(0, 65535))
    api_key_file: str | None = flag(None, "HTTP API keys, one per line: /v1/ calls need Authorization: Bearer KEY "
                                          "(401 otherwise)")
    served_model_name: str | None = flag(None, "the model id of the HTTP API (default: the --model directory's "
                                               "name)")
    http_max_body_bytes: int = flag(MAX_BODY_BYTES, "largest HTTP request body (413 beyond)", bounds=(1, None))
    http_max_prompts: int = flag(MAX_PROMPTS, "prompts in one /v1/completions request (400 naming `prompt` "
                                              "beyond)", bounds=(1, None))
    chat_max_tokens: int = flag(4096, "an HTTP chat request that sets no max_tokens generates up to this many "
                                      "tokens (never past the context)", bounds=(1, None))

    def autoscaler(self, perf: PerfModel) -> Autoscaler | None:
        """The pool-size controller `--autoscale MIN:MAX` runs (the same bounds for both pools), under this
        router's SLA targets (else AUTOSCALE_TTFT_MS / AUTOSCALE_TPOT_MS)."""
        if not self.autoscale:
            return None
        bounds = Bounds.parse(self.autoscale)
        fleet = FleetLoad(prometheus_query(self.autoscale_prometheus), self.autoscale_routers, self.autoscale_window,
                          self.autoscale_period) if self.autoscale_prometheus else None
        return Autoscaler(perf, (self.ttft_slo_ms or AUTOSCALE_TTFT_MS) / 1e3, (self.tpot_slo_ms or AUTOSCALE_TPOT_MS)
                          / 1e3, bounds, bounds, headroom=self.autoscale_headroom,
                          down_after_s=self.autoscale_down_after, ranks=self.decode_dp, fleet=fleet)

    def __post_init__(self) -> None:
        check_bounds(self, flag_name)


MAX_REQUEST_ID = 128
REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:/-]*")
MAX_MESSAGES = 1024
MAX_TOOLS = 128
# A peer's failure a request survives by going on elsewhere (the others are the request's own fault).
MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED)


class _Malformed:
    """What the lenient deserializer hands the handler for bytes that are no GenerateRequest."""

    def __init__(self, reason: str):
        self.reason = reason


def _lenient(parse):
    """A request that does not parse (e.g. a string field that is not UTF-8) becomes INVALID_ARGUMENT
    in the handler instead of gRPC's INTERNAL."""
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            return _Malformed(str(exc) or "malformed request")
    return deserialize


@dataclass
class Instance:
    address: str
    stub: object
    view: PrefillView | DecodeView
    outstanding: int = 0  # changed only on the event loop: no lock
    failures: int = 0  # consecutive failed load polls (back-off)
    due: float = 0.0  # next load poll (monotonic seconds)


class Pool:
    """Instances of one kind, with the router's view of each (its load reports, plus what was
    dispatched since the last one); an instance whose calls or load polls fail is taken out of the
    choice and polled back in with back-off. An address `dns:NAME:PORT` (a Kubernetes headless
    service) stands for every address NAME resolves to, re-resolved every `discover` period: pods
    that appear are added, pods that vanish are dropped. `file:PATH` stands for the addresses listed in
    PATH, one a line, re-read alike (what `pdserve up --autoscale` writes as it starts and drains instances)."""

    def __init__(self, kind: str, addresses: list[str], stub_cls, credentials: Credentials | None = None):
        self.kind, self.stub_cls, self.credentials = kind, stub_cls, credentials
        metrics.FAILOVERS.labels(kind)  # exported at 0 from the start
        self.static = [a for a in addresses if not a.startswith(("dns:", "file:"))]
        self.names = [a[4:] for a in addresses if a.startswith("dns:")]
        self.files = [a[5:] for a in addresses if a.startswith("file:")]
        self.instances: list[Instance] = [self._make(a) for a in self.static]
        self._retired: list[tuple[float, grpc.aio.Channel]] = []

    def _make(self, address: str) -> Instance:
        channel = aio_channel(address, self.credentials)
        view = PrefillView if self.kind == "prefill" else DecodeView
        inst = Instance(address, self.stub_cls(channel), view(address))
        inst.view.up = False  # until its first load report: a router never counts on an instance it has not reached
        inst.channel = channel  # type: ignore[attr-defined]
        return inst

    async def discover(self, period: float = 5.0,
                       resolve: Callable[[str, str], Awaitable[list[str]]] | None = None) -> None:
        """Keep the instances of the dns: names current (static addresses always stay)."""
        resolve = resolve or _resolve
        while True:
            await self.refresh(resolve)
            await asyncio.sleep(period)

    async def refresh(self, resolve: Callable[[str, str], Awaitable[list[str]]]) -> None:
        wanted = list(self.static)
        for name in self.names:
            host, _, port = name.rpartition(":")
            try:
                wanted += [a for a in await resolve(host, port) if a not in wanted]
            except OSError as exc:  # keep what we have: a DNS hiccup must not empty the pool
                log.warning("%s: cannot resolve %s: %s", self.kind, host, exc)
                wanted += [x.address for x in self.instances if x.address not in wanted]
        for path in self.files:
            try:
                wanted += [a for a in Path(path).read_text().split() if a not in wanted]
            except OSError as exc:
                log.warning("%s: cannot read %s: %s", self.kind, path, exc)
                wanted += [x.address for x in self.instances if x.address not in wanted]
        current = {x.address: x for x in self.instances}
        added = [a for a in wanted if a not in current]
        gone = [x for x in self.instances if x.address not in wanted]
        if added or gone:
            log.info("%s instances: +%s -%s", self.kind, added, [x.address for x in gone])
            self.instances = [current.get(a) or self._make(a) for a in wanted]
            now = time.monotonic()
            self._retired += [(now, x.channel) for x in gone]  # type: ignore[attr-defined]
        while self._retired and time.monotonic() - self._retired[0][0] > 600:  # in-flight streams drain first
            await self._retired.pop(0)[1].close()

    async def watch_health(self, period: float = 2.0) -> None:
        """pdserve_router_instance_up for every instance, from its health check every `period` s."""
        while True:
            for inst in list(self.instances):
                try:
                    stub = health_pb2_grpc.HealthStub(inst.channel)  # type: ignore[attr-defined]
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=period)
                    up = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    up = False
                metrics.INSTANCE_UP.labels(self.kind, inst.address).set(int(up))
            await asyncio.sleep(period)

    async def poll_loads(self, interval: float, metadata: tuple) -> None:
        """Refresh every instance's view from its GetLoad report every `interval` s; a failing one is
        out (its view down) and retried after interval · 2^failures (at most 8 s)."""
        while True:
            now = time.monotonic()
            await asyncio.gather(*(self._poll(inst, interval, metadata) for inst in list(self.instances)
                                   if now >= inst.due))
            await asyncio.sleep(interval)

    async def _poll(self, inst: Instance, interval: float, metadata: tuple) -> None:
        try:
            report = await inst.stub.GetLoad(internal_pb2.LoadRequest(), timeout=max(1.0, 4 * interval),
                                             metadata=metadata)
        except grpc.RpcError:
            inst.failures += 1
            inst.view.up = False
            inst.due = time.monotonic() + min(MAX_POLL_BACKOFF, interval * 2 ** inst.failures)
            metrics.INSTANCE_PLACEABLE.labels(self.kind, inst.address).set(0)
            return
        inst.failures, inst.view.up = 0, True
        metrics.INSTANCE_PLACEABLE.labels(self.kind, inst.address).set(1)
        view = inst.view
        if isinstance(view, PrefillView):
            view.queued_tokens = report.queued_prompt_tokens
            view.block_size = report.block_size or view.block_size
            if report.prefix_filter:
                view.prefix = PrefixFilter(report.prefix_filter)
        else:
            ranks = report.ranks or [internal_pb2.RankLoad(running=report.running, free_blocks=report.free_blocks,
                                                            active_leases=report.active_leases)]
            view.ranks = [RankView(r.running + r.active_leases, r.tokens, r.queued_prompt_tokens) for r in ranks]
            view.free_blocks = min(r.free_blocks for r in ranks)
            view.block_size = report.block_size or view.block_size

    @staticmethod
    def ordered(instances: list[Instance], indices: list[int]) -> list[Instance]:
        """`instances` (a snapshot the policy saw) at `indices` in the policy's order, repeats dropped,
        then the rest as the fail-over order."""
        seen = list(dict.fromkeys(indices))
        return [instances[i] for i in seen] + [x for i, x in enumerate(instances) if i not in seen]


@dataclass
class Validated:
    """A request that passed validation: its prompt, its sampling and how its reply is parsed."""

    ids: list[int]
    params: SamplingParams
    reply: ReplyParser


@dataclass
class Progress:
    """What a request's client has been sent so far, carried across migrations."""

    valid: Validated
    label: str  # the client's request_id (echoed in every response), or ""
    t0: float
    t_end: float  # the request's deadline or --request-timeout, whichever is first
    streamed: list[int] = field(default_factory=list)  # tokens sent to the client
    migrations: int = 0
    failed_at: float | None = None  # when the last try failed, until the next token (the pause a client sees)
    t_first: float | None = None
    t_last: float | None = None
    cached: int = 0  # prompt tokens the first prefill found in its prefix cache
    echo: PromptEcho | None = None  # for the first message, with prompt logprobs


@dataclass
class PromptEcho:
    """What a request's first message carries when it asked for prompt logprobs: its prompt and their
    logprobs (from the prefill instance, or from decode's first message after a local prefill)."""

    ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]


@contextlib.contextmanager
def _in_flight(inst: Instance) -> Iterator[Instance]:
    inst.outstanding += 1
    try:
        yield inst
    finally:
        inst.outstanding -= 1


class Invalid(ValueError):
    pass


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The public front: every handler is a coroutine, so open streams cost no threads; prompts are
    tokenized on a small pool (the tokenizer releases the GIL) so a long one delays no one."""

    def __init__(self, cfg: RouterConfig):
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the router needs at least one --prefill and one --decode address")
        self.cfg = cfg
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        self.tokenizer = Tokenizer.from_model_dir(cfg.model, self.model_config.bos_token_id)
        self.limits = RequestLimits(self.model_config.max_position_embeddings, self.model_config.vocab_size)
        self.constraints = ConstraintCompiler(self.tokenizer.path if self.tokenizer else None,
                                              self.model_config.vocab_size, list(self.model_config.eos_token_ids))
        self.credentials = Credentials.of(cfg)
        self.metadata = self.credentials.metadata
        self.prefill = Pool("prefill", cfg.prefill, internal_pb2_grpc.PrefillStub, self.credentials)
        self.decode = Pool("decode", cfg.decode, internal_pb2_grpc.DecodeStub, self.credentials)
        self.perf = PerfModel.load(cfg.profile) if cfg.profile else PerfModel()
        self.policy = POLICIES[cfg.policy](self.perf)
        metrics.IN_FLIGHT.set_function(lambda: self.in_flight)
        self._tokenizers = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self._background: set[asyncio.Task] = set()
        self.in_flight = 0  # Generate calls being served (changed only on the event loop)
        self.draining = False  # SIGTERM: new calls are refused (router.drain), the ones in flight run to their end

    @property
    def max_prompt_bytes(self) -> int:
        return self.cfg.max_prompt_bytes or min(8 << 20, 32 * self.model_config.max_position_embeddings)

    async def _encode(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, self.tokenizer.encode, text)

    async def validate(self, request: generation_pb2.GenerateRequest, open_ended: bool = False,
                       ) -> tuple[list[int], SamplingParams]:
        """Return (prompt ids, params) or raise Invalid naming the field. Sizes are checked before any
        work (tokenizing included). `open_ended` (HTTP chat): without max_tokens the reply may run to
        --chat-max-tokens, never past the context."""
        if isinstance(request, _Malformed):
            raise Invalid(f"request: not a valid GenerateRequest ({request.reason}); strings must be UTF-8")
        if len(request.request_id) > MAX_REQUEST_ID or not REQUEST_ID_CHARS.fullmatch(request.request_id):
            raise Invalid(f"request_id: at most {MAX_REQUEST_ID} characters of [A-Za-z0-9._:/-]")
        if len(request.messages) > MAX_MESSAGES:
            raise Invalid(f"messages: at most {MAX_MESSAGES} messages, got {len(request.messages)}")
        if len(request.tools) > MAX_TOOLS:
            raise Invalid(f"tools: at most {MAX_TOOLS} tools, got {len(request.tools)}")
        size = len(request.prompt.encode()) + sum(
            len(m.content.encode()) + len(m.reasoning_content.encode())
            + sum(len(c.arguments.encode()) + len(c.name.encode()) for c in m.tool_calls) for m in request.messages
        ) + sum(len(t.name.encode()) + len(t.description.encode()) + len(t.parameters.encode()) for t in request.tools)
        if size > self.max_prompt_bytes:
            raise Invalid(f"prompt: {size} bytes of text exceed the limit of {self.max_prompt_bytes}")
        if len(request.prompt_token_ids) > self.limits.context_tokens:  # before the rest is read
            raise Invalid(f"prompt_token_ids: {len(request.prompt_token_ids)} tokens exceed the model's context "
                          f"of {self.limits.context_tokens}")
        given = [name for name, present in (("prompt", bool(request.prompt)),
                                            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
                                            ("messages", len(request.messages) > 0)) if present]
        if len(given) != 1:
            raise Invalid("exactly one of prompt, prompt_token_ids and messages must be set"
                          + (f" ({' and '.join(given)} were {'both' if len(given) == 2 else 'all'} set)"
                             if given else " (all are empty)"))
        if given[0] != "prompt_token_ids" and self.tokenizer is None:
            raise Invalid(f"{given[0]}: this model has no tokenizer; send prompt_token_ids")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(request.sla, name)
            if not (value >= 0 and value < float("inf")):
                raise Invalid(f"sla.{name}: must be a finite number >= 0, got {value}")
        try:
            params = sampling_from_proto(request.sampling_params)
            params.validate()
        except ValueError as exc:
            raise Invalid(f"sampling_params.{exc}") from exc
        tools, choice = self._tools(request, given[0])
        forced = choice == "required" or choice in {t.name for t in tools}
        if forced:  # a forced call: the grammar makes it
            if params.structured is not None:
                raise Invalid(f"tool_choice: a forced tool call ({choice!r}) cannot take structured_output too")
            grammar = tool_call_grammar(tools, None if choice == "required" else choice)
            request.sampling_params.structured_output.grammar = grammar
            params.structured = StructuredOutput(ConstraintKind.GRAMMAR, grammar)
        thinking = given[0] == "messages" and request.thinking
        reply = ReplyParser(thinking, tools if tools and choice != "none" else None, forced=forced)
        if reply.parses:  # </think> and the end of the calls must reach the parser
            request.sampling_params.skip_special_tokens = params.skip_special_tokens = False
        if params.structured is not None:
            if given[0] == "messages" and request.thinking:  # the constraint is the answer's, after the reasoning
                request.sampling_params.structured_output.after_reasoning = True
                params.structured = dataclasses.replace(params.structured, after_reasoning=True)
            try:  # compiled here, before any work (cached: a schema compiles once), on the tokenizer threads
                await asyncio.get_running_loop().run_in_executor(self._tokenizers, self.constraints.matcher,
                                                                 params.structured)
            except ValueError as exc:
                raise Invalid(str(exc) if str(exc).startswith("structured_output") else
                              f"sampling_params.structured_output: {exc}") from exc
        if given[0] == "messages":
            try:
                text = render_messages([ChatMessage(m.role, m.content, m.reasoning_content,
                                                    tuple(ToolCall(c.name, c.arguments, c.id) for c in m.tool_calls),
                                                    m.tool_call_id) for m in request.messages],
                                       thinking=request.thinking, tools=tools if choice != "none" else ())
            except ValueError as exc:
                raise Invalid(str(exc)) from exc
            ids = await self._encode(text)
        elif given[0] == "prompt":
            ids = await self._encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
        if open_ended and not request.sampling_params.HasField("max_tokens"):
            params.max_tokens = max(1, min(self.cfg.chat_max_tokens, self.limits.context_tokens - len(ids)))
            request.sampling_params.max_tokens = params.max_tokens  # what prefill and decode are sent
        try:
            self.limits.check_prompt_ids(ids, given[0])
            self.limits.check_length(len(ids), params.max_tokens, "sampling_params.max_tokens")
            self.limits.check_sampling(params)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc
        return Validated(ids, params, reply)

    @staticmethod
    def _tools(request: generation_pb2.GenerateRequest, given: str) -> tuple[list[ToolFunction], str]:
        """The request's tools and its tool_choice (default "auto" with tools), validated naming the field."""
        if request.tools and given != "messages":
            raise Invalid("tools: only with messages (the chat encoding renders them)")
        tools = []
        for i, t in enumerate(request.tools):
            try:
                parameters = json.loads(t.parameters) if t.parameters else {}
                if not isinstance(parameters, dict):
                    raise ValueError("must be a JSON schema object")
                tool = ToolFunction(t.name, t.description, parameters)
                tool.validate(f"tools[{i}]")
            except ValueError as exc:
                raise Invalid(str(exc) if str(exc).startswith("tools[") else f"tools[{i}].parameters: {exc}") from exc
            tools.append(tool)
        if len({t.name for t in tools}) != len(tools):
            raise Invalid("tools: function names must be distinct")
        choice = request.tool_choice or ("auto" if tools else "none")
        if choice not in ("auto", "none", "required") and choice not in {t.name for t in tools}:
            raise Invalid(f"tool_choice: expected auto, none, required or one of the tools' names, got {choice!r}")
        if choice != "none" and not tools:
            raise Invalid(f"tool_choice: {choice!r} needs tools")
        return tools, choice

    async def Generate(self, request, context):
        """The gRPC API's Generate."""
        async for out in self.generate(request, context):
            yield out

    async def generate(self, request, context, open_ended: bool = False):
        """Generate's path, for the gRPC API and the HTTP API alike (router.http passes an HttpCall as
        `context`). Admission first: beyond --max-concurrent-requests a call is refused at once, before
        any work (health checks are never refused: an overloaded router is not a dead one)."""
        if self.draining:
            metrics.request_done("router", "UNAVAILABLE", "draining")
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_S * 1000)),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        if self.in_flight >= self.cfg.max_concurrent_requests:
            metrics.request_done("router", "RESOURCE_EXHAUSTED", "overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the router is at its limit of {self.cfg.max_concurrent_requests} requests in flight")
        self.in_flight += 1
        try:
            async for out in self._generate(request, context, open_ended):
                yield out
        finally:
            self.in_flight -= 1

    async def _generate(self, request, context, open_ended: bool):
        """Validate, then run the request, migrating it when an instance fails under it: the stream goes on
        from another pair with the tokens already sent as the end of its prompt (no token repeated or
        missed; see LLMEngine.make_sequence), up to --migration-limit times."""
        t0 = time.perf_counter()
        try:
            valid = await self.validate(request, open_ended)
        except Invalid as exc:
            metrics.request_done("router", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.ARRIVALS.inc()
        metrics.TOKENS.labels("router", "prompt").inc(len(valid.ids))
        deadline = context.time_remaining()  # None without a deadline
        if deadline is not None and deadline <= 0:
            metrics.request_done("router", "DEADLINE_EXCEEDED", "deadline")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it started")
        timeout = min(self.cfg.request_timeout, deadline) if deadline is not None else self.cfg.request_timeout
        progress = Progress(valid, request.request_id, t0, t0 + timeout)
        while True:
            try:
                async for out in self._attempt(request, context, progress):
                    yield out
                return
            except grpc.RpcError as exc:  # an instance failed after admission
                code, cause = exc.code(), _cause(exc)
                migratable = code in MIGRATABLE and cause != "request_fault"  # it alone failed a step: not moved
                if not migratable or progress.migrations >= self.cfg.migration_limit \
                        or time.perf_counter() >= progress.t_end:
                    spent = migratable and progress.migrations >= self.cfg.migration_limit
                    metrics.request_done("router", _map_code(code, cause).name, "migration_limit" if spent else cause)
                    await context.abort(_map_code(code, cause), f"{exc.details()}" + (
                        f" (after {progress.migrations} migrations)" if progress.migrations else ""))
                progress.migrations += 1
                progress.failed_at = time.perf_counter()
                metrics.MIGRATIONS.labels(cause).inc()
                log.warning("request %s: %s (%s); migrating with %d tokens streamed (%d/%d)", progress.label,
                            cause, exc.details(), len(progress.streamed), progress.migrations,
                            self.cfg.migration_limit)

    async def _attempt(self, request, context, progress: Progress):
        """One try: admit on a pair, reserve, prefill (the prompt plus what was streamed before a
        migration), stream from decode. A failure after admission raises the peer's RpcError."""
        params, md = progress.valid.params, self.metadata
        ids, resumed = progress.valid.ids + progress.streamed, len(progress.streamed)
        rid = uuid.uuid4().hex  # internal ids are the router's (a new one per try); the client's is only a label
        remaining = params.max_tokens - resumed
        first_try = progress.migrations == 0
        ttft_s = (request.sla.ttft_ms or self.cfg.ttft_slo_ms) / 1e3 if first_try else 0.0  # a started stream goes on
        tpot_s = (request.sla.tpot_ms or self.cfg.tpot_slo_ms) / 1e3
        prefills, decodes = await self._reachable(context, progress.t_end)
        try:
            pairs = await self._admit(ids, remaining, ttft_s, tpot_s, request.priority, prefills, decodes,
                                      progress.t0)
        except Rejected as exc:  # before any work anywhere
            metrics.request_done("router", "RESOURCE_EXHAUSTED", "sla")
            context.set_trailing_metadata((("retry-after-ms", str(round(exc.retry_after_s * 1e3))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry after {exc.retry_after_s:.1f} s")
        best = pairs[0]
        # Count the request on its chosen pair at once, until their next reports: admissions made while
        # its Reserve is in flight must see it, or a burst lands on views that all still say idle.
        chosen_pre, chosen_dec = None if best.local else prefills[best.prefill].view, decodes[best.decode].view
        chosen_rank = chosen_dec.ranks[chosen_dec.least_loaded()]
        if chosen_pre is not None:
            chosen_pre.queued_tokens += len(ids)
        local_prompt = len(ids) if best.local else 0  # prompt tokens the decode rank will prefill itself
        chosen_rank.count(len(ids) + remaining, local_prompt)
        reserve_req = internal_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids), max_tokens=remaining)
        full_or_down = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.DEADLINE_EXCEEDED)
        timeout = max(0.0, progress.t_end - time.perf_counter())
        dec, reserve = await self._first_ok(self.decode, Pool.ordered(decodes, [c.decode for c in pairs]),
                                            lambda inst: inst.stub.Reserve(reserve_req, timeout=PEER_TIMEOUT,
                                                                           metadata=md), retry_on=full_or_down)
        view = dec.view
        rank = view.ranks[min(reserve.dp_rank, len(view.ranks) - 1)]
        if rank is not chosen_rank:  # another instance or DP rank took it
            rank.count(len(ids) + remaining, local_prompt)
        sampling = request.sampling_params
        with _in_flight(dec):
            lease_id = reserve.destination.lease_id
            claimed = False
            try:
                if first_try:
                    metrics.QUEUE.observe(time.perf_counter() - progress.t0)
                decode_req = internal_pb2.DecodeRequest(request_id=rid, lease_id=lease_id, prompt_token_ids=ids,
                                                        sampling_params=sampling, local_prefill=best.local,
                                                        num_resumed=resumed)
                first = None
                if not best.local:  # the prompt goes to a prefill instance, which pushes its KV into the lease
                    prefill_req = internal_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=ids, sampling_params=sampling,
                        destination=reserve.destination, priority=request.priority, num_resumed=resumed)
                    preferred = [c.prefill for c in pairs if decodes[c.decode] is dec]
                    order = Pool.ordered(prefills, preferred or [c.prefill for c in pairs])
                    if order[0].view is not chosen_pre:
                        order[0].view.queued_tokens += len(ids)  # until its next report
                    pre, first = await self._first_ok(self.prefill, order, lambda inst: inst.stub.Prefill(
                        prefill_req, timeout=timeout, metadata=md), retry_on=(grpc.StatusCode.UNAVAILABLE,))
                    metrics.PAIRS.labels(pre.address, dec.address).inc()
                    decode_req.first_token_id, decode_req.rng_state = first.first_token_id, first.rng_state
                    if first.HasField("first_token_logprob"):
                        decode_req.first_token_logprob.CopyFrom(first.first_token_logprob)
                metrics.PREFILL_PATHS.labels("local" if best.local else "disaggregated").inc()
                stream = dec.stub.Decode(decode_req, timeout=timeout, metadata=md)
                claimed = True
                if not progress.streamed:  # this try's first message is the client's first
                    progress.cached = 0 if first is None else first.cached_prompt_tokens
                    metrics.TOKENS.labels("router", "cached_prompt").inc(progress.cached)
                    progress.echo = PromptEcho(progress.valid.ids, [] if first is None else list(
                        first.prompt_logprobs)) if params.prompt_logprobs is not None else None  # local: from decode
                try:
                    async for out in self._relay(stream, dec, progress, best):
                        yield out
                finally:
                    stream.cancel()  # a no-op when it ended; otherwise the client left: decode lets go
            finally:
                if not claimed:  # off the handler: it may be cancelled already
                    task = asyncio.ensure_future(self._release(dec, lease_id))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)

    async def _reachable(self, context, t_end: float) -> tuple[list[Instance], list[Instance]]:
        """The pools' instances once at least one of each is up: a request that arrives while they start
        or reconnect waits for them (up to --instance-wait, within its deadline) instead of failing, and a
        request to a dead pool fails that soon, not when its deadline ends (600 s for a client without one)."""
        t_end = min(t_end, time.perf_counter() + self.cfg.instance_wait)
        while True:
            prefills, decodes = list(self.prefill.instances), list(self.decode.instances)  # discovery may change
            if any(i.view.up for i in prefills) and any(i.view.up for i in decodes):
                return prefills, decodes
            if time.perf_counter() + self.cfg.load_interval >= t_end:
                metrics.request_done("router", "UNAVAILABLE", "no_instances")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill or no decode instance is reachable "
                                    f"(prefill up: {sum(i.view.up for i in prefills)} of {len(prefills)}, decode "
                                    f"up: {sum(i.view.up for i in decodes)} of {len(decodes)})")
            await asyncio.sleep(self.cfg.load_interval / 2)

    @staticmethod
    def _cached_prefix(ids: list[int], prefills: list[Instance]) -> list[int]:
        """Per prefill instance, the prompt tokens its prefix cache holds (by its latest summary;
        at least one token is always computed, as the scheduler does)."""
        hashes: dict[int, list[bytes]] = {}
        out = []
        for inst in prefills:
            view = inst.view
            if view.prefix is None:
                out.append(0)
                continue
            bs = view.block_size
            if bs not in hashes:
                hashes[bs] = prompt_block_hashes(ids, bs, (len(ids) - 1) // bs)
            out.append(view.prefix.cached_prefix_blocks(hashes[bs]) * bs)
        return out

    async def _release(self, dec: Instance, lease_id: str) -> None:
        try:
            await dec.stub.Release(internal_pb2.ReleaseRequest(lease_id=lease_id), timeout=PEER_TIMEOUT,
                                   metadata=self.metadata)
        except grpc.RpcError:
            pass  # the lease expires on its own

    async def _relay(self, stream, dec: Instance, progress: Progress, predicted):  # predicted: the policy's Choice
        """Decode's stream as the client's: its text through the reply parser (reasoning, answer, tool
        calls), the prompt echo (prompt logprobs asked) on the first message. Observed latencies calibrate the
        performance model (first tries only). A failing stream marks its instance down and raises."""
        reply, prompt_tokens = progress.valid.reply, len(progress.valid.ids)
        try:
            async for msg in stream:
                now = time.perf_counter()
                if msg.token_ids:
                    if progress.t_first is None:
                        progress.t_first = now
                        metrics.TTFT.observe(now - progress.t0)
                        if predicted.local:
                            self.perf.observe_local_ttft(predicted.batch, predicted.ttft_raw_s, now - progress.t0)
                        else:
                            self.perf.observe_ttft(predicted.queued_tokens, predicted.ttft_raw_s, now - progress.t0,
                                                   predicted.busy_beside)
                    elif progress.failed_at is not None:  # the first token after a migration
                        metrics.MIGRATION_PAUSE.observe(now - progress.failed_at)
                        progress.failed_at = None
                    elif progress.t_last is not None:
                        metrics.TPOT.observe((now - progress.t_last) / len(msg.token_ids))
                    progress.t_last = now
                    progress.streamed += msg.token_ids
                piece = reply.feed(msg.text, final=bool(msg.finish_reason))
                finish = "tool_calls" if msg.finish_reason == "stop" and reply.called else msg.finish_reason
                out = generation_pb2.GenerateResponse(token_ids=msg.token_ids, text=piece.content,
                                                      reasoning_text=piece.reasoning, finish_reason=finish,
                                                      request_id=progress.label, logprobs=msg.logprobs)
                for delta, call_id in zip(piece.tool_calls, piece.ids, strict=True):
                    out.tool_calls.add(index=delta.index, id=call_id, name=delta.name,
                                       arguments_delta=delta.arguments_delta)
                if progress.echo is not None:
                    out.prompt_token_ids.extend(progress.echo.ids)
                    out.prompt_logprobs.extend(msg.prompt_logprobs or progress.echo.logprobs)
                    progress.echo = None
                if finish:
                    n = len(progress.streamed)
                    if n > 1 and progress.migrations == 0 and progress.t_first is not None:
                        self.perf.observe_tpot(predicted.batch, predicted.tpot_raw_s,
                                               (progress.t_last - progress.t_first) / (n - 1))
                    out.usage.prompt_tokens, out.usage.completion_tokens = prompt_tokens, n
                    out.usage.cached_prompt_tokens = progress.cached
                    metrics.request_done("router", "OK", msg.finish_reason)
                    metrics.E2E.observe(time.perf_counter() - progress.t0)
                    metrics.TOKENS.labels("router", "output").inc(n)
                yield out
        except grpc.RpcError as exc:
            if exc.code() in MIGRATABLE and _cause(exc) != "request_fault":
                dec.view.up = False  # out of the choice until its load poll succeeds again
            raise

    async def _admit(self, ids: list[int], max_tokens: int, ttft_s: float, tpot_s: float, priority: int,
                     prefills: list, decodes: list, t0: float) -> list:
        """The policy's pairs for this request. With --admission-wait-ms a request no pair can serve yet is
        held and chosen again after each load poll, its TTFT target shrinking by the time it has waited,
        until a pair fits or waiting longer could not make the target (then Rejected, as at once)."""
        cached = self._cached_prefix(ids, prefills)
        wait_until = t0 + self.cfg.admission_wait_ms / 1e3
        while True:
            waited = time.perf_counter() - t0
            ttft_left = max(ttft_s - waited, 1e-6) if ttft_s else 0.0
            try:
                local = len(ids) <= self.cfg.local_prefill_tokens
                return self.policy.choose(Request(len(ids), max_tokens, ttft_left, tpot_s, cached_by_prefill=cached,
                                                  priority=priority, local_prefill=local),
                                          [x.view for x in prefills], [x.view for x in decodes])
            except Rejected:
                pause = self.cfg.load_interval
                if time.perf_counter() + pause > wait_until or (ttft_s and waited + pause >= ttft_s):
                    raise
                await asyncio.sleep(pause)

    @staticmethod
    async def _first_ok(pool: Pool, candidates: list[Instance], call, retry_on: tuple) -> tuple[Instance, object]:
        """await call(instance) on each candidate in turn, failing over on `retry_on` codes (an
        instance that is down leaves the choice until its load poll succeeds again); raises the last
        error when none succeeds."""
        for i, inst in enumerate(candidates):
            try:
                with _in_flight(inst):
                    return inst, await call(inst)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    inst.view.up = False
                if exc.code() in retry_on and i + 1 < len(candidates):
                    log.warning("%s: %s; trying the next instance", inst.address, exc.code().name)
                    metrics.FAILOVERS.labels(pool.kind).inc()
                    continue
                raise
        raise AssertionError("unreachable: a pool has at least one instance")


async def _resolve(host: str, port: str) -> list[str]:
    """host:port addresses of every IP `host` resolves to (IPv6 bracketed), in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def _cause(exc: grpc.RpcError) -> str:
    """Why a try failed, as the migrations metric counts it."""
    details = (exc.details() or "").lower()
    if details.startswith("request fault"):  # shared.engine.isolation.REQUEST_FAULT: it alone failed an engine step
        return "request_fault"
    if "draining" in details:
        return "drain"
    if "kv push" in details or "kv receiver" in details:
        return "kv_transfer"
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.INTERNAL: "engine_error"}.get(
        exc.code(), exc.code().name.lower())


def _map_code(code: grpc.StatusCode, cause: str = "") -> grpc.StatusCode:
    """Peer failures surface as UNAVAILABLE; the peer's own verdicts pass through (a request fault: INTERNAL)."""
    passthrough = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
    return code if code in passthrough or cause == "request_fault" else grpc.StatusCode.UNAVAILABLE


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_flags(RouterConfig, p, argv)


async def serve(cfg: RouterConfig) -> tuple[grpc.aio.Server, int, Lifecycle]:
    servicer = GenerationServicer(cfg)

    def register(server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_lenient(generation_pb2.GenerateRequest.FromString),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Generate": handler}),))

    server, port, life = await start_server(cfg.host, cfg.port, [register], [SERVICE], servicer.credentials,
                                            public=True)
    life.servicer = servicer
    return server, port, life


async def _report_readiness(servicer: GenerationServicer, life: Lifecycle, period: float) -> None:
    """The router's health: SERVING only while it reaches at least one prefill and one decode instance
    (every pod of a deployment starts at once: a router must not take traffic it cannot place)."""
    serving = None
    await life.set(False)
    while not servicer.draining:  # a draining router stays NOT_SERVING
        reachable = any(i.view.up for i in servicer.prefill.instances) and \
            any(i.view.up for i in servicer.decode.instances)
        if reachable != serving:
            await life.set(reachable)
            serving = reachable
        await asyncio.sleep(period / 2)


async def _autoscale(servicer: GenerationServicer, controller: Autoscaler, period: float, window: float) -> None:
    """Every `period` s: the load of the last `window` s from this router's counters → the controller →
    each pool's desired size, exported for whatever scales the pools (pdserve up, KEDA)."""
    desired = Target(len(servicer.prefill.instances), len(servicer.decode.instances))
    readings = collections.deque([(time.monotonic(), read_counters(metrics.REGISTRY.get_sample_value))])
    while True:
        metrics.DESIRED.labels("prefill").set(desired.prefill)
        metrics.DESIRED.labels("decode").set(desired.decode)
        await asyncio.sleep(period)
        now = time.monotonic()
        readings.append((now, read_counters(metrics.REGISTRY.get_sample_value)))
        while len(readings) > 2 and readings[1][0] <= now - window:
            readings.popleft()
        (t_prev, prev), cur = readings[0], readings[-1][1]
        obs = observe(prev, cur, now - t_prev)
        wanted = controller.decide(now, obs, desired)
        if wanted != desired:
            log.info("autoscale: %.2f req/s (prompt %.0f, output %.0f tokens): prefill %d → %d, decode %d → %d",
                     obs.rate, obs.mean_prompt_tokens, obs.mean_output_tokens, desired.prefill, wanted.prefill,
                     desired.decode, wanted.decode)
        desired = wanted


async def _serve_until_stopped(cfg: RouterConfig) -> None:
    _, port, life = await serve(cfg)
    servicer = life.servicer
    watchers = [asyncio.create_task(pool.watch_health()) for pool in (servicer.prefill, servicer.decode)]
    watchers += [asyncio.create_task(pool.poll_loads(cfg.load_interval, servicer.metadata))
                 for pool in (servicer.prefill, servicer.decode)]
    watchers += [asyncio.create_task(pool.discover(cfg.discovery_interval))
                 for pool in (servicer.prefill, servicer.decode) if pool.names or pool.files]
    watchers.append(asyncio.create_task(_report_readiness(servicer, life, cfg.load_interval)))
    if (controller := cfg.autoscaler(servicer.perf)) is not None:
        watchers.append(asyncio.create_task(_autoscale(servicer, controller, cfg.autoscale_period,
                                                       cfg.autoscale_window)))
    servicer._background.update(watchers)  # referenced for the life of the process
    http = gate = None
    if cfg.http_port is not None:  # up before the port file appears: a launcher may call both at once
        front = OpenAIFrontDoor(servicer, cfg.served_model_name or Path(cfg.model).resolve().name,
                                read_api_keys(cfg.api_key_file), cfg.http_max_body_bytes, cfg.http_max_prompts)
        gate = DrainGate(front.app)
        http, http_task, http_port = await start_http(gate, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
        scheme = "https" if cfg.tls_cert else "http"
        log.info("OpenAI-compatible HTTP API at %s://%s:%d/v1", scheme, cfg.host, http_port)
        if cfg.port_file:
            write_port_file(f"{cfg.port_file}.http", http_port)
    life.announce(port, cfg.port_file, f"router listening on {cfg.host}:{port}")

    async def refuse_new() -> None:
        servicer.draining = True
        if gate is not None:
            gate.draining = True
        log.info("draining: %d requests in flight (%d over HTTP), up to %.0f s", servicer.in_flight,
                 gate.in_flight if gate is not None else 0, cfg.drain_seconds)

    async def drain_http(deadline: float) -> None:
        if http is not None:
            if not await gate.drained(deadline):
                log.warning("drain: %d HTTP requests still in flight at --drain-seconds; cutting them", gate.in_flight)
            http.should_exit = True
            await http_task

    await life.run(cfg.drain_seconds, on_stop=refuse_new, alongside=drain_http)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    die_with_launcher()
    cfg = parse_args(argv)
    metrics.start_metrics_server(cfg.metrics_port, cfg.host, cfg.port_file)
    asyncio.run(_serve_until_stopped(cfg))
