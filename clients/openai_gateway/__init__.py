"""An OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, and vLLM's `/tokenize`, `/detokenize`, `/version`) over the scheduler's gRPC client
API, run as its own service: `python -m clients.openai_gateway --port 8000 --server HOST:PORT`."""
