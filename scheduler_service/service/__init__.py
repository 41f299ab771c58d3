"""The scheduler as a gRPC service: the engine loop that drives the executor, the link to it,
the client-facing Generation servicer and server, request intake, output streams and metrics."""
