"""google.rpc.Code values the executor protocol carries as plain integers
(RejectedRequest.code in splitserve/executor/v1/executor.proto), defined once for both ends."""

INVALID_ARGUMENT = 3
INTERNAL = 13
