"""Command-line client: `python -m clients generate|tokenize|status [--server HOST:PORT] ...`.

Generated text goes to stdout; errors and (with -v) log lines go to stderr, so the text can be
piped on its own."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from clients.errors import SplitserveError
from clients.request_builder import GenerateOptions
from clients.results import GenerationResult
from clients.sync_client import Client
from service_support.cli_help import DefaultsHelpFormatter
from service_support.default_ports import DEFAULT_SCHEDULER_ADDRESS

logger = logging.getLogger("clients.cli")
API_KEY_ENV = "SPLITSERVE_API_KEY"
SERVER_ENV = "SPLITSERVE_SERVER"
# A bound a person at a terminal wants: a chat answer of a few paragraphs. Without one a request
# may run to the model's maximum length (8,192 tokens for the default model).
DEFAULT_MAX_TOKENS = 256


def build_parser(prog: str = "python -m clients") -> argparse.ArgumentParser:
    # -v is taken before and after the subcommand, so `splitserve generate -v` works too.
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log to stderr"
    )
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter, parents=[verbosity]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate",
        help="stream the answer to a prompt",
        formatter_class=DefaultsHelpFormatter,
        parents=[verbosity],
    )
    _add_server(generate)
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user turn")
    generate.add_argument(
        "--max-tokens",
        type=at_least(0),
        default=DEFAULT_MAX_TOKENS,
        help="most tokens to generate; 0 leaves it to the server, which runs to the model's "
        "maximum length unless its generation config sets a limit",
    )
    sampling = "default: the server's, from the model's generation_config.json (see `status`)"
    generate.add_argument("--temperature", type=float, help=f"0 is greedy ({sampling})")
    generate.add_argument("--top-p", type=float, help=sampling)
    generate.add_argument("--top-k", type=at_least(0), help=sampling)
    generate.add_argument("--seed", type=int, help="same seed, same tokens (default: random)")
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument(
        "-n",
        type=at_least(1),
        default=1,
        help="choices to generate from the one prompt (each printed whole, on lines of its own, once all have ended)",
    )
    generate.add_argument(
        "--tools",
        type=json_list,
        metavar="JSON",
        help="with --chat: functions the model may call, as OpenAI's tools list (JSON text); "
        "the answer is the model's own call text",
    )
    generate.add_argument(
        "--tenant",
        help="whose request it is (x-splitserve-tenant); counts where the scheduler has no API keys "
        "or the key is marked `*` in its key file, else the key's tenant applies",
    )
    generate.add_argument(
        "--ttft-deadline-ms",
        type=at_least(1),
        metavar="MS",
        help="most milliseconds to the first token; a scheduler that predicts a miss refuses at once",
    )
    generate.add_argument(
        "--tpot-target-ms",
        type=at_least(1),
        metavar="MS",
        help="mean milliseconds between tokens wanted; a scheduler that predicts a miss refuses at once",
    )
    grammar = generate.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", metavar="SCHEMA", help="answer in JSON following this schema (JSON text)")
    grammar.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    grammar.add_argument("--regex", help="answer matching this regular expression")
    grammar.add_argument("--choice", action="append", help="answer with exactly one of these (repeatable)")
    grammar.add_argument("--grammar", metavar="EBNF", help="answer following this EBNF grammar (start rule root)")

    tokenize = commands.add_parser(
        "tokenize",
        help="print the token ids of a text",
        formatter_class=DefaultsHelpFormatter,
        parents=[verbosity],
    )
    _add_server(tokenize)
    tokenize.add_argument("text")
    tokenize.add_argument("--chat", action="store_true", help="tokenize as a user turn")

    status = commands.add_parser(
        "status",
        help="print the model and the server's state",
        formatter_class=DefaultsHelpFormatter,
        parents=[verbosity],
    )
    _add_server(status)
    return parser


def json_list(text: str) -> list[object]:
    """An argparse type: JSON text of a list, or argparse's one-line error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("must be a JSON list")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, or argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _add_server(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get(SERVER_ENV) or DEFAULT_SCHEDULER_ADDRESS,
        metavar="HOST:PORT",
        help=f"the scheduler (default: ${SERVER_ENV}, else {DEFAULT_SCHEDULER_ADDRESS})",
    )
    parser.add_argument("--timeout", type=float, help="deadline per call, in seconds")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA of the server's certificate: connect over TLS")
    parser.add_argument("--tls", action="store_true", help="connect over TLS trusting the system's root certificates")
    parser.add_argument(
        "--api-key-file",
        type=Path,
        help=f"file whose first line is the API key (default: the {API_KEY_ENV} environment variable)",
    )


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        lines = args.api_key_file.read_text().split()
        if not lines:
            raise ValueError(f"{args.api_key_file} holds no API key")
        return lines[0]
    return os.environ.get(API_KEY_ENV) or None


def main(argv: Sequence[str] | None = None, prog: str = "python -m clients") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        api_key = _api_key(args)
        root_certificates = args.tls_ca.read_bytes() if args.tls_ca else None
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        with Client(
            args.server,
            timeout=args.timeout,
            api_key=api_key,
            root_certificates=root_certificates,
            tls=args.tls,
        ) as client:
            if args.command == "generate":
                return _generate(client, args)
            if args.command == "tokenize":
                return _tokenize(client, args)
            return _status(client)
    except SplitserveError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        # A value the client library refuses before sending (sampling ranges, combinations).
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Leaving the stream loop already cancelled the call, so the server aborted it.
        return 130


def _structured_output(args: argparse.Namespace) -> dict[str, object] | None:
    """The one grammar flag given, as structured_output; the server checks the grammar."""
    given = {
        "json": args.json_schema,
        "json_object": args.json_object or None,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": args.grammar,
    }
    return next(({key: value} for key, value in given.items() if value is not None), None)


def _print_choices(result: GenerationResult) -> int:
    """Several choices, each under a line naming it: their streams interleave, so each is
    printed once whole."""
    for choice in result.choices:
        sys.stdout.write(f"[choice {choice.index}] finish_reason={choice.finish_reason}\n{choice.text}\n")
    sys.stdout.flush()
    logger.info("event=generated choices=%d usage=%s", len(result.choices), [choice.usage for choice in result.choices])
    return 0


def _generate(client: Client, args: argparse.Namespace) -> int:
    options: GenerateOptions = {
        "max_tokens": args.max_tokens or None,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "structured_output": _structured_output(args),
        "tools": args.tools,
        "ttft_deadline_ms": args.ttft_deadline_ms,
        "tpot_target_ms": args.tpot_target_ms,
    }
    prompt = {"messages": [("user", args.prompt)]} if args.chat else {"prompt": args.prompt}
    if args.n > 1:
        return _print_choices(client.generate(**prompt, n=args.n, tenant=args.tenant, **options))
    deltas = client.stream(**prompt, tenant=args.tenant, **options)
    last = None
    for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        last = delta
    # The answer's line ends before any log line, which goes to stderr on a line of its own.
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.finish_reason is not None:
        logger.info(
            "event=generated finish_reason=%s stop_reason=%s usage=%s timings=%s",
            last.finish_reason,
            last.stop_reason,
            last.usage,
            last.timings,
        )
    return 0


def _tokenize(client: Client, args: argparse.Namespace) -> int:
    if args.chat:
        result = client.tokenize(messages=[("user", args.text)])
    else:
        result = client.tokenize(args.text)
    print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens}, ensure_ascii=False))
    return 0


def _status(client: Client) -> int:
    """The server's state even when no executor is up: the model is known only once one was
    reached, and each executor's entry then says why it is not serving."""
    report: dict[str, object] = {}
    try:
        report["model"] = _as_dict(client.model_info())
    except SplitserveError as error:
        if error.code != grpc.StatusCode.UNAVAILABLE:
            raise
        report["model"] = None
        report["model_unavailable"] = error.details
    report["server"] = _as_dict(client.server_status())
    print(json.dumps(report, indent=2))
    return 0


def _as_dict(message: Message) -> dict[str, object]:
    return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
