"""What the launcher prints for the user on stdout: the question, then where everything
listens and what to try against it."""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from scheduler_service.launch.children import Child


def print_question(question: str) -> None:
    print(f"\n> {question}", flush=True)


def print_banner(
    address: str,
    executor_address: str,
    gateway: str,
    metrics: str,
    model_name: str,
    children: Sequence[Child],
) -> None:
    logs = ", ".join(str(c.log_path) for c in children if c.log_path is not None)
    command = client_program()
    # grpcurl is not something setup installs: suggested only where it is on PATH.
    grpcurl = (
        f"""
  grpcurl -plaintext {address} list
  grpcurl -plaintext {address} grpc.health.v1.Health/Check
  grpcurl -plaintext {executor_address} describe"""
        if shutil.which("grpcurl")
        else ""
    )
    print(
        f"""
splitserve is running; Ctrl-C stops it.
  scheduler  {address}   (client API, grpc.health.v1, reflection)
  executor   {executor_address}   (executor API, grpc.health.v1, reflection)
  gateway    {gateway}/v1   (OpenAI-compatible HTTP API, model {model_name!r})
  metrics    {metrics}
  logs       {logs}

Try:
  {command} generate --server {address} --chat "Write a haiku about the sea"
  {command} status --server {address}
  curl -s {gateway}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hi"}}]}}'{grpcurl}
""",
        flush=True,
    )


def client_program() -> str:
    """How to run the client from here: the installed `splitserve` beside this Python (the one
    setup installed), else this Python's `-m clients`."""
    installed = Path(sys.executable).parent / "splitserve"
    if installed.is_file():
        return shlex.quote(str(installed))
    return f"{shlex.quote(sys.executable)} -m clients"
