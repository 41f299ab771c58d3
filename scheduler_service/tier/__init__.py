"""The Planner API (protos/splitserve/planner/v1/planner.proto) between the scheduler tier's
front-ends, which serve clients, and a planner, which owns the executors, at both its ends:
request_codec (a request on the wire between them); on the planner, planner_servicer (the API),
frontend_link (its side of one front-end's stream: the RemoteSink the engine streams into) and
planner_access (its token); on a front-end, planner_link and planner_client (its planners,
failover and resubmission) and admin_forwarder (Admin passed on to the planner). The processes
that serve them are in process/.
"""
