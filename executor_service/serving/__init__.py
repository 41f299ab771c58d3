"""The Executor gRPC service (server), who may call it (access), its command-line settings and
its Prometheus metrics. It runs whatever StepRunner it is given and knows no model."""
