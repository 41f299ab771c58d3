"""The client API, as the all-in-one scheduler and a front-end both serve it: a request's intake
(caps, large messages parsed off the event loop, tokenizing), the Generation servicer, each
request's output stream to its client and how far that client may fall behind, the API keys, the
rule for new requests while draining, the one table of gRPC status codes, and tracing. It drives
no executor: whoever plans its requests is a backend.Backend, the engine (planner/) in this
process or a planner over the Planner API (tier/), and those rooms import this one, never the
reverse."""
