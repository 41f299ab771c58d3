"""Step plans and results between the planner's plain records and the executor protocol."""

from collections.abc import Collection

from protos import rpc_codes
from protos.splitserve.executor.v1 import executor_pb2 as pb
from scheduler_service.core.errors import ErrorKind, RequestError
from scheduler_service.core.sampling_params import SamplingParams
from scheduler_service.core.step_plan import (
    HeldState,
    ImportDone,
    LateBitmasks,
    StepOutput,
    StepPlan,
)

# An entry the executor refused is wrong (INVALID_ARGUMENT) or tripped it (INTERNAL).
_REJECTION_KINDS = {rpc_codes.INVALID_ARGUMENT: ErrorKind.INVALID, rpc_codes.INTERNAL: ErrorKind.INTERNAL}


def sampler_config(params: SamplingParams, eos_token_ids: Collection[int] = ()) -> pb.SamplerConfig:
    """The executor's share of a request's settings; stop conditions other than the masking
    that min_tokens needs stay with the scheduler."""
    config = pb.SamplerConfig(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
    if params.seed is not None:
        config.has_seed, config.seed = True, params.seed
    if params.logprobs is not None:
        config.want_logprobs, config.num_logprobs = True, params.logprobs
    if params.prompt_logprobs is not None:
        config.want_prompt_logprobs, config.num_prompt_logprobs = True, params.prompt_logprobs
    if params.logit_bias:
        config.logit_bias_token_ids.extend(token for token, _ in params.logit_bias)
        config.logit_bias_values.extend(bias for _, bias in params.logit_bias)
    config.allowed_token_ids.extend(params.allowed_token_ids)
    if params.min_tokens:
        config.min_tokens = params.min_tokens
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        config.min_tokens_stop_ids.extend(sorted(ending))
    return config


def plan_to_proto(plan: StepPlan, eos_token_ids: Collection[int] = ()) -> pb.StepPlan:
    message = pb.StepPlan(
        step_id=plan.step_id,
        dropped_request_ids=plan.dropped_request_ids,
        want_held_requests=plan.want_held_requests,
    )
    for new in plan.new_requests:
        message.new_requests.append(
            pb.NewRequest(
                request_id=new.request_id,
                token_ids=new.token_ids,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=new.num_scheduled_tokens,
                sampling=sampler_config(new.sampling, eos_token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                handle=new.handle,
                allowed_token_bitmask=new.allowed_token_bitmask,
                state_slot=new.state_slot,
                state_source_slot=new.state_source_slot,
                state_in_slot=new.state_in_slot,
            )
        )
    for cont in plan.continuing_requests:
        message.continuing_requests.append(
            pb.ContinuingRequest(
                request_id=cont.request_id,
                num_scheduled_tokens=cont.num_scheduled_tokens,
                new_block_ids=cont.new_block_ids,
                allowed_token_bitmask=cont.allowed_token_bitmask,
                bitmask_follows=cont.bitmask_follows,
                draft_token_ids=cont.draft_token_ids,
                num_model_drafts=cont.num_model_drafts,
                draft_bitmasks=cont.draft_bitmasks,
            )
        )
    if plan.decode_handles:
        message.decode_handles.extend(plan.decode_handles)
        message.decode_block_handles.extend(plan.decode_block_handles)
        message.decode_block_ids.extend(plan.decode_block_ids)
    for copy in plan.block_copies:
        message.copy_block_sources.append(copy.source)
        message.copy_block_destinations.append(copy.destination)
    for checkpoint in plan.state_checkpoints:
        message.state_checkpoints.append(
            pb.StateCheckpoint(request_id=checkpoint.request_id, num_tokens=checkpoint.num_tokens, slot=checkpoint.slot)
        )
    for export in plan.kv_exports:
        message.kv_exports.append(
            pb.KvExport(transfer_id=export.transfer_id, block_ids=export.block_ids, state_slot=export.state_slot)
        )
    message.ended_exports.extend(plan.ended_exports)
    for kv_import in plan.kv_imports:
        message.kv_imports.append(
            pb.KvImport(
                transfer_id=kv_import.transfer_id,
                source_address=kv_import.source_address,
                first_block=kv_import.first_block,
                block_ids=kv_import.block_ids,
                state_slot=kv_import.state_slot,
            )
        )
    message.cancelled_imports.extend(plan.cancelled_imports)
    for device_block, host_block in plan.swap_out:
        message.swap_out_device_blocks.append(device_block)
        message.swap_out_host_blocks.append(host_block)
    for host_block, device_block in plan.swap_in:
        message.swap_in_host_blocks.append(host_block)
        message.swap_in_device_blocks.append(device_block)
    return message


def late_bitmasks_to_proto(late: LateBitmasks) -> pb.StepPlan:
    """The message that brings a plan's late bitmasks (not itself a plan: step_id 0)."""
    return pb.StepPlan(
        bitmasks_for_step=late.step_id,
        late_bitmasks=[
            pb.LateBitmask(request_id=request_id, allowed_token_bitmask=bitmask) for request_id, bitmask in late.bitmasks
        ],
    )


def output_from_proto(result: pb.StepResult) -> StepOutput:
    output = StepOutput(
        step_id=result.step_id,
        forward_time_s=result.forward_time_s,
        step_time_s=result.step_time_s,
        decode_token_ids=result.decode_token_ids,
    )
    for item in result.outputs:
        output.sampled[item.request_id] = item.token_ids
        if item.logprobs:
            output.logprobs[item.request_id] = item.logprobs
        if item.prompt_logprobs:
            output.prompt_logprobs[item.request_id] = item.prompt_logprobs
    for rejected in result.rejected:
        kind = _REJECTION_KINDS.get(rejected.code, ErrorKind.INTERNAL)
        output.rejected[rejected.request_id] = RequestError(kind, rejected.message)
    if result.HasField("failure"):
        output.failure = result.failure.message
    if result.held_requests:
        output.held_requests = {
            held.request_id: HeldState(tuple(held.block_ids), held.num_computed_tokens, held.state_slot)
            for held in result.held_requests
        }
    output.kv_imports_done = [
        ImportDone(done.transfer_id, done.ok, done.error, done.bytes, done.seconds) for done in result.kv_imports_done
    ]
    return output
