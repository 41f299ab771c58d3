"""The scheduler as a tier (protos/splitserve/planner/v1/planner.proto): front-ends that serve
clients and a planner that owns the executors, in processes of their own.

Modules: request_codec (a request on the wire between them), remote_sink and frontend_link (the
planner's side of one front-end's stream), planner_servicer (the Planner API), planner_access
(its token), planner_link and planner_client (a front-end's side: its planners, failover and
resubmission), planner_server and frontend_server (the two roles' serve()), all_in_one (one
planner and N front-end processes behind one port).
"""
