"""A request between a front-end and a planner (SubmittedRequest): everything needed to run it,
or to run it again from where it is, and nothing the planner does not use (its text, its stop
strings: the front-end detokenizes and applies them)."""

import time

from protos.splitserve.planner.v1 import planner_pb2
from protos.splitserve.v1 import generation_pb2 as pb
from scheduler_service.core.request import Request
from scheduler_service.core.sampling_params import SamplingDefaults, SamplingParams
from scheduler_service.core.tenants import DEFAULT_TENANT
from scheduler_service.frontend.request_intake import sampling_from_proto
from scheduler_service.structured.spec_codec import spec_to_proto


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingParams:
    """Every field set, defaults already applied by the front-end: the planner applies none."""
    message = pb.SamplingParams(
        min_tokens=sampling.min_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
        keep_special_tokens=not sampling.skip_special_tokens,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        logit_bias=dict(sampling.logit_bias),
        allowed_token_ids=sampling.allowed_token_ids,
    )
    if sampling.max_tokens is not None:
        message.max_tokens = sampling.max_tokens
    if sampling.seed is not None:
        message.seed = sampling.seed
    if sampling.logprobs is not None:
        message.logprobs = sampling.logprobs
    if sampling.prompt_logprobs is not None:
        message.prompt_logprobs = sampling.prompt_logprobs
    if sampling.structured_output is not None:
        message.structured_output.CopyFrom(spec_to_proto(sampling.structured_output))
    return message


def submitted(request: Request, handle: int, num_planner_losses: int, trace_context: dict[str, str]) -> planner_pb2.SubmittedRequest:
    """The front-end's request as it goes to a planner, with every token delivered so far."""
    return planner_pb2.SubmittedRequest(
        handle=handle,
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        sampling=sampling_to_proto(request.sampling),
        priority=request.priority,
        cache_salt=request.cache_salt,
        received_ago_s=max(0.0, time.monotonic() - request.arrival_time),
        trace_context=trace_context,
        num_planner_losses=num_planner_losses,
        fork_of=request.fork_of,
        tenant=request.tenant,
        ttft_deadline_ms=round(request.ttft_deadline_s * 1000),
        tpot_target_ms=round(request.tpot_target_s * 1000),
    )


def request_of(message: planner_pb2.SubmittedRequest) -> Request:
    """The planner's request for a submitted one; its arrival is the front-end's."""
    prompt = list(message.prompt_token_ids)
    return Request(
        request_id=message.request_id,
        prompt_token_ids=prompt,
        # The front-end resolved every default; the built-in ones here only fill max_tokens' None.
        sampling=sampling_from_proto(message.sampling, SamplingDefaults()),
        priority=message.priority,
        cache_salt=message.cache_salt,
        arrival_time=time.monotonic() - message.received_ago_s,
        token_ids=[*prompt, *message.output_token_ids],
        fork_of=message.fork_of,
        tenant=message.tenant or DEFAULT_TENANT,
        ttft_deadline_s=message.ttft_deadline_ms / 1000,
        tpot_target_s=message.tpot_target_ms / 1000,
    )
