"""Proto <-> the shared vocabulary's dataclasses: sampling parameters, structured outputs, logprobs, load
reports. Every hop converts a message here once, at its front, and works on the dataclass after."""

from __future__ import annotations

from shared.protocol.load import LoadReport, RankLoad
from shared.protocol.sampling import SamplingParams, TokenLogprob
from shared.protocol.structured import ConstraintKind, StructuredOutput
from shared.rpc.pdserve.v1 import generation_pb2, internal_pb2

# proto3 `optional` fields of SamplingParams: unset, they keep SamplingParams' own defaults
OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "skip_special_tokens",
                            "repetition_penalty", "logprobs", "prompt_logprobs")


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """Proto → SamplingParams; an unset optional field takes the default SamplingParams declares (once)."""
    optional = {name: getattr(msg, name) for name in OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    return SamplingParams(top_k=msg.top_k, stop_token_ids=list(msg.stop_token_ids), stop=list(msg.stop),
                          ignore_eos=msg.ignore_eos, presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty, min_p=msg.min_p, min_tokens=msg.min_tokens,
                          logit_bias=dict(msg.logit_bias), structured=structured_from_proto(msg.structured_output)
                          if msg.HasField("structured_output") else None, **optional)


def structured_from_proto(msg: generation_pb2.StructuredOutput) -> StructuredOutput:
    """Proto → StructuredOutput; ValueError when no constraint is set."""
    which = msg.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured_output: set one of json_schema, json_object, regex, grammar, choice")
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return StructuredOutput(kind, choices=tuple(msg.choice.choices), after_reasoning=msg.after_reasoning)
    spec = "" if kind is ConstraintKind.JSON_OBJECT else getattr(msg, which)
    return StructuredOutput(kind, spec, after_reasoning=msg.after_reasoning)


def structured_to_proto(so: StructuredOutput) -> generation_pb2.StructuredOutput:
    msg = generation_pb2.StructuredOutput(after_reasoning=so.after_reasoning)
    if so.kind is ConstraintKind.CHOICE:
        msg.choice.choices.extend(so.choices)
    elif so.kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, so.kind.value, so.spec)
    return msg


def sampling_to_proto(p: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                        top_k=p.top_k, stop_token_ids=p.stop_token_ids, stop=p.stop,
                                        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens,
                                        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                        repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                                        min_tokens=p.min_tokens, logit_bias=p.logit_bias)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        msg.structured_output.CopyFrom(structured_to_proto(p.structured))
    return msg


def logprob_to_proto(lp: TokenLogprob) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=lp.top_ids,
                                       top_logprobs=lp.top_logprobs)


def logprob_from_proto(msg: generation_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, list(msg.top_ids), list(msg.top_logprobs))


def load_to_proto(report: LoadReport) -> internal_pb2.LoadReport:
    """An instance's load as it travels to the router (totals over its ranks, then each rank)."""
    ranks = [internal_pb2.RankLoad(rank=r.rank, running=r.running, waiting=r.waiting, free_blocks=r.free_blocks,
                                   total_blocks=r.total_blocks, active_leases=r.active_leases, tokens=r.tokens,
                                   admitted=r.admitted, queued_prompt_tokens=r.queued_prompt_tokens)
             for r in report.ranks]
    return internal_pb2.LoadReport(running=report.running, waiting=report.waiting, free_blocks=report.free_blocks,
                                   total_blocks=report.total_blocks, active_leases=report.active_leases,
                                   ranks=ranks, queued_prompt_tokens=report.queued_prompt_tokens,
                                   block_size=report.block_size)


def load_from_proto(msg: internal_pb2.LoadReport) -> LoadReport:
    """The router's reading of a GetLoad answer; a report without ranks is one rank of its totals."""
    ranks = [RankLoad(r.rank, r.running, r.waiting, r.free_blocks, r.total_blocks, r.active_leases, r.tokens,
                      r.admitted, r.queued_prompt_tokens) for r in msg.ranks]
    if not ranks:
        ranks = [RankLoad(0, msg.running, msg.waiting, msg.free_blocks, msg.total_blocks, msg.active_leases,
                          queued_prompt_tokens=msg.queued_prompt_tokens)]
    return LoadReport(tuple(ranks), msg.block_size)
