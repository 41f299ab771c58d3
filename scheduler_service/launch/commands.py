"""What each child runs: its command line and its environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scheduler_service.launch.options import LaunchOptions

# A stuck system fails a question instead of hanging `--once` (and the tests) forever.
ASK_TIMEOUT_S = 120.0


def prepare_model_command(options: LaunchOptions) -> list[str]:
    # Run by name, not imported: the scheduler side imports no executor code.
    command = [sys.executable, "-m", "executor_service.prepare_model"]
    if options.cache_dir is not None:
        command += ["--cache-dir", str(options.cache_dir)]
    return command


def executor_command(options: LaunchOptions, model_dir: Path, token_file: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "executor_service",
        "--model",
        str(model_dir),
        "--host",
        options.host,
        "--port",
        str(options.executor_port),
        "--threads",
        str(options.threads),
        "--executor-token-file",
        str(token_file),
    ]


def scheduler_command(
    options: LaunchOptions, model_dir: Path, executor_address: str, token_file: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "scheduler_service",
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--executor",
        executor_address,
        "--tokenizer",
        str(options.tokenizer or model_dir),
        "--metrics-port",
        str(options.metrics_port),
        "--executor-token-file",
        str(token_file),
    ]


def gateway_command(options: LaunchOptions, model_dir: Path, address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clients.openai_gateway",
        "--host",
        options.host,
        "--port",
        str(options.gateway_port),
        "--server",
        address,
        # The folder is named for the model, the name OpenAI clients then send as `model`.
        "--served-model-name",
        model_dir.name,
    ]


def client_command(question: str, address: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "clients",
        "generate",
        "--server",
        address,
        "--chat",
        "--max-tokens",
        "64",
        "--temperature",
        "0",
        "--timeout",
        str(ASK_TIMEOUT_S),
        question,
    ]


def child_environment(name: str, options: LaunchOptions) -> dict[str, str]:
    # Unbuffered, so a ready line reaches the log file the moment it is written.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name == "executor":
        # OpenMP pools beyond torch's own threads would fight them for the same cores.
        env["OMP_NUM_THREADS"] = str(options.threads)
    return env
