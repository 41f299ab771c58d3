"""Grammars compiled for one tokenizer, cached by content, and the per-request states made from
them.

xgrammar (and the torch it imports) loads on the first constrained request, not at start: a
scheduler that never sees one never pays for it. Compiling a JSON schema against a 49k-token
vocabulary takes ~0.1 s, so compile() runs off the event loop: the all-in-one scheduler's intake
calls it while it validates a request, and a tier's planner before it takes one (a tier's
front-ends compile nothing), so state() finds the grammar cached.
"""

import asyncio
import importlib
import json
import logging
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from scheduler_service.core.errors import ErrorKind, RequestRejected
from scheduler_service.core.structured_output import GrammarKind, StructuredOutput
from scheduler_service.structured.grammar_state import GrammarState
from scheduler_service.text.tokenizer import TextProcessor

logger = logging.getLogger(__name__)

# Compiled grammars kept per vocabulary; the oldest go beyond this (a JSON schema's is ~100 KB).
DEFAULT_CACHE_LIMIT_BYTES = 128 << 20

# xgrammar's errors start with a timestamp and its C++ source position: not for a client.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class Grammars:
    def __init__(self, text: TextProcessor | None, cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES) -> None:
        self._text = text
        self._cache_limit_bytes = cache_limit_bytes
        self._xgr: Any = None
        # One compiler per vocabulary size (the model's logits can be wider than the tokenizer).
        self._compilers: dict[int, Any] = {}
        self._lock = threading.Lock()

    async def compile(self, spec: StructuredOutput, vocab_size: int) -> None:
        """Compiles the grammar into the cache, off the event loop; RequestRejected says why it
        cannot be (INVALID: the grammar is wrong; UNSUPPORTED: this server cannot constrain)."""
        await asyncio.to_thread(self._compiled, spec, vocab_size)

    def state(
        self, spec: StructuredOutput, vocab_size: int, stop_token_ids: Iterable[int], output_token_ids: Sequence[int]
    ) -> GrammarState:
        """A request's place in its grammar after `output_token_ids`; RequestRejected as
        compile(), or INVALID when the output so far does not follow the grammar."""
        compiled = self._compiled(spec, vocab_size)
        state = GrammarState(self._xgr, compiled, stop_token_ids, vocab_size)
        for position, token in enumerate(output_token_ids):
            if not state.accept(token):
                raise RequestRejected(
                    ErrorKind.INVALID,
                    f"output token {token} at position {position} does not follow the request's structured_output",
                )
        return state

    def _compiled(self, spec: StructuredOutput, vocab_size: int) -> Any:
        compiler = self._compiler(vocab_size)
        try:
            return _compile(compiler, spec)
        except Exception as error:
            message = _CPP_PREFIX.sub("", str(error)).strip() or type(error).__name__
            logger.info("event=grammar_refused kind=%s reason=%r", spec.kind.value, message)
            raise RequestRejected(
                ErrorKind.INVALID, f"structured_output {spec.kind.value} cannot be compiled: {message}"
            ) from None

    def _compiler(self, vocab_size: int) -> Any:
        with self._lock:
            compiler = self._compilers.get(vocab_size)
            if compiler is not None:
                return compiler
            if self._text is None:
                raise RequestRejected(
                    ErrorKind.UNSUPPORTED, "structured_output needs a tokenizer: start the server with --tokenizer"
                )
            xgr = self._import()
            info = xgr.TokenizerInfo.from_huggingface(
                self._text.tokenizer, vocab_size=vocab_size, stop_token_ids=list(self._text.eos_token_ids)
            )
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self._cache_limit_bytes)
            self._compilers[vocab_size] = compiler
            logger.info("event=grammar_compiler_ready vocab_size=%d", vocab_size)
            return compiler

    def _import(self) -> Any:
        if self._xgr is None:
            try:
                self._xgr = importlib.import_module("xgrammar")
            except ImportError:
                raise RequestRejected(
                    ErrorKind.UNSUPPORTED,
                    "structured_output needs xgrammar on the scheduler: pip install 'splitserve[structured]'",
                ) from None
        return self._xgr


def _compile(compiler: Any, spec: StructuredOutput) -> Any:
    kind = spec.kind
    if kind is GrammarKind.JSON_SCHEMA:
        return compiler.compile_json_schema(spec.source, strict_mode=True)
    if kind is GrammarKind.JSON_OBJECT:
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
    if kind is GrammarKind.REGEX:
        return compiler.compile_regex(spec.source)
    if kind is GrammarKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(spec.choices))
    return compiler.compile_grammar(spec.source)


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose sentences are exactly these strings (JSON string escapes are
    xgrammar's EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
