"""The router's flags (RouterConfig): one declaration from which `python -m router`'s arguments, `pdserve up`'s
and the chart's values are derived (shared.config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from router.autoscale import (
    AUTOSCALE_TPOT_MS,
    AUTOSCALE_TTFT_MS,
    AutoscaleConfig,
    Autoscaler,
    Bounds,
    FleetLoad,
    prometheus_query,
)
from router.perf import PerfModel
from router.policy import POLICIES
from shared.config import REQUIRED, EndpointConfig, check_bounds, flag, flag_name, same_as

MAX_BODY_BYTES = 32 << 20  # the largest HTTP request body accepted (413 beyond)
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (400 naming `prompt` beyond)


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
    no_kv_fetch: bool = flag(False, "never tell a prefill instance to fetch a prompt's cached prefix from another "
                                    "instance (it computes what it lacks)")
    no_token_bus: bool = flag(False, "stream each request's tokens from decode on its own gRPC stream instead of "
                                     "on one token bus per decode instance (a step's tokens for this router in one "
                                     "message)")
    local_prefill_tokens: int = flag(0, "selective disaggregation: a prompt with at most this many tokens the "
                                        "decode instance does not cache (a follow-up turn: its new ones) is "
                                        "prefilled on the decode instance itself (chunked within its token "
                                        "budget, beside its running decodes) when the SLA model predicts its "
                                        "first token sooner there than through a prefill instance (sla policy; "
                                        "0: every prompt goes to a prefill instance)", bounds=(0, None))
    overflow_prefill_tokens: int = flag(512, "overflow of a burst: a prompt with at most this many tokens the decode "
                                             "instance does not cache is prefilled on the decode instance itself "
                                             "while every prefill instance has at least this many prompt tokens "
                                             "queued, when the SLA model predicts its first token sooner there (sla "
                                             "policy; a prefill pool with room takes every prompt; never for an "
                                             "endpoint picker's pair; 0: never)", bounds=(0, None))
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
    autoscale_burst_sigmas: float = same_as(AutoscaleConfig, "autoscale_burst_sigmas")
    autoscale_window: float = same_as(AutoscaleConfig, "autoscale_window")
    autoscale_lead: float = same_as(AutoscaleConfig, "autoscale_lead")
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
    kserve_port: int | None = flag(None, "also serve KServe v2 / the Open Inference Protocol over gRPC "
                                         "(inference.GRPCInferenceService: tritonclient, KServe; text in "
                                         "`text_input`, out in `text_output`) on this port (0: a free one, reported "
                                         "in PORT_FILE.kserve); TLS as the gRPC API's", bounds=(0, 65535))
    epp_port: int | None = flag(None, "also serve the Gateway API Inference Extension's endpoint picker (Envoy "
                                      "ext_proc) on this port (0: a free one, reported in PORT_FILE.epp): a "
                                      "Gateway asks it which router serves each request; it places the request "
                                      "as this router would and names the pair in headers", bounds=(0, 65535))
    epp_endpoints: list[str] = flag([], "the routers the endpoint picker picks from when the gateway names no "
                                        "subset: their HTTP addresses, comma-separated (dns:NAME:PORT: every "
                                        "address NAME resolves to; default: this router's own --http-port)")
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
                          burst_sigmas=self.autoscale_burst_sigmas,
                          down_after_s=self.autoscale_down_after, ranks=self.decode_dp, fleet=fleet,
                          lead_s=self.autoscale_lead, window_s=self.autoscale_window)

    @property
    def model_name(self) -> str:
        """The model's name on the HTTP and KServe APIs: --served-model-name, else the --model directory's."""
        return self.served_model_name or Path(self.model).resolve().name

    def __post_init__(self) -> None:
        check_bounds(self, flag_name)
        if self.epp_port is not None and self.http_port is None and not self.epp_endpoints:
            raise ValueError("--epp-port picks among routers' HTTP APIs: give --http-port (this router) or "
                             "--epp-endpoints")


__all__ = ["RouterConfig"]
