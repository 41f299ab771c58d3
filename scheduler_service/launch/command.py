"""The `splitserve` command: one installed entry point whose subcommands are the services and
tools, in the ecosystem's habit (`vllm serve`, `text-generation-launcher`).

    splitserve run            the default model, an executor and a scheduler (make run)
    splitserve serve DIR      the same for a model folder of your own, nothing asked
    splitserve scheduler ...  python -m scheduler_service
    splitserve executor ...   python -m executor_service
    splitserve gateway ...    python -m clients.openai_gateway
    splitserve generate|tokenize|status ...   python -m clients
    splitserve prepare-model  python -m executor_service.prepare_model
    splitserve executor-token FILE   python -m service_support.make_token

Each subcommand takes exactly the flags of the module it names (`splitserve X --help` lists
them with their defaults). A subcommand's module is imported only when it runs, so an executor
container never loads the scheduler, nor a client torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PROG = "splitserve"


@dataclass(slots=True, frozen=True)
class Subcommand:
    module: str
    summary: str
    # Words put before the user's arguments (the client CLI's own subcommand).
    prefix: tuple[str, ...] = ()
    # The module's function that runs it.
    function: str = "main"


SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand(
        "scheduler_service.launch.__main__",
        "start an executor, a scheduler and the gateway with the default model (or --model DIR), "
        "ask it a question, and print where they listen",
    ),
    "serve": Subcommand(
        "scheduler_service.launch.__main__",
        "serve a local model folder: executor, scheduler and gateway on the default ports",
        function="serve_main",
    ),
    "scheduler": Subcommand("scheduler_service.__main__", "serve the Generation API in front of executors"),
    "executor": Subcommand("executor_service.__main__", "serve a model's forward passes to a scheduler"),
    "gateway": Subcommand("clients.openai_gateway.__main__", "serve the OpenAI HTTP API over a scheduler"),
    "generate": Subcommand("clients.cli", "stream the answer to a prompt", ("generate",)),
    "tokenize": Subcommand("clients.cli", "print the token ids of a text", ("tokenize",)),
    "status": Subcommand("clients.cli", "print the model and the server's state", ("status",)),
    "executor-token": Subcommand(
        "service_support.make_token", "write a new executor token into a file (kept if one is there)"
    ),
    "prepare-model": Subcommand(
        "executor_service.prepare_model", "prepare the default model (SmolLM2-135M-Instruct) once"
    ),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"usage: {PROG} COMMAND [flags]   ({PROG} COMMAND --help lists a command's flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in SUBCOMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    command = SUBCOMMANDS.get(name)
    if command is None:
        sys.stderr.write(f"{PROG}: unknown command {name!r}\n\n{usage()}")
        return 2
    entry: Callable[..., int] = getattr(importlib.import_module(command.module), command.function)
    if command.prefix:
        # The client CLI names its own subcommand; its usage line then reads `splitserve generate`.
        return entry([*command.prefix, *rest], prog=PROG)
    return entry(rest, prog=f"{PROG} {name}")


if __name__ == "__main__":
    sys.exit(main())
