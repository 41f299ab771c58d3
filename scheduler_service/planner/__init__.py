"""What drives the executors: the engine (every executor's lane, where each request goes, what
happens when an executor goes), a lane's link to its executor (the plan/result stream, plans and
results to and from the protocol, audits), executor states and the Admin servicer that changes
them, discovery of executor addresses, the scheduler's metrics and the step trace. The engine
sends each request's tokens to a request_sink.RequestSink: its client's output stream
(frontend/) in this process, or the front-end that holds the client (tier/)."""
