"""The scheduler service: request state, queues and policies, the step planner, the engine loop
that drives executors, and the client-facing gRPC server.

The planning modules (request, sampling_params, policy, request_queue, step_plan, stop_checker,
scheduler, sim_executor) import no torch and no gRPC.
"""
