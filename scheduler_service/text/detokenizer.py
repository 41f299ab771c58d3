"""Incremental detokenization of one request's output, with stop strings.

A token's text can depend on the tokens before it (SentencePiece drops the leading space of the
first token of a decode; byte-level BPE splits one character over several tokens), so each new
token is decoded inside a small window of the tokens before it and the text the window already
produced is subtracted (the prefix-offset/read-offset technique). The window stays a few tokens
long, so each token costs a constant amount of work however long the output grows.

Only final text is returned: nothing that ends in an incomplete character, and nothing that could
still turn out to be the start of a stop string (unless the stop string is to be returned too,
vLLM's include_stop_str_in_output: then nothing needs holding back).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_service.text.token_decoder import token_decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Tokens of already-returned text kept in front of new tokens: enough for any tokenizer whose
# pieces depend on their left neighbour.
CONTEXT_TOKENS = 5
# A character spans at most 4 bytes, hence at most 4 tokens. Output that stays incomplete for far
# longer is invalid bytes, which would otherwise grow the window without end; it is returned
# as replacement characters instead.
MAX_HELD_TOKENS = 16
# How many earlier cut points are tried when the preferred one splits a character (or leaves only
# skipped special tokens as context); past MAX_WINDOW_TOKENS the window is cut regardless.
CUT_SEARCH_TOKENS = 8
MAX_WINDOW_TOKENS = 64


@dataclass(slots=True, frozen=True)
class StringStop:
    """A stop string that ended the output, and which of the tokens pushed with it ended it."""

    stop_string: str
    # How many of the pushed tokens are output: those up to the one whose text completed the
    # stop string. A push of several (a step's accepted drafts) may bring tokens after it, which
    # decoding one token at a time would never have sampled.
    num_tokens: int


@dataclass(slots=True, frozen=True)
class DetokenizerStep:
    """What one push made final."""

    # Text to stream now.
    text_delta: str
    # The stop string that ended the output (the end of text_delta only when it is included),
    # if one appeared.
    stop: StringStop | None = None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into streamed text, one push at a time."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._decode = token_decoder(tokenizer, skip_special_tokens)
        # Stop strings apply from this many output tokens on (vLLM's min_tokens semantics).
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # The prompt's last tokens are the first window's context: the first output token must
        # decode as it would following the prompt (e.g. keep its leading space).
        self._window: list[int] = list(prompt_token_ids[-(CONTEXT_TOKENS + CUT_SEARCH_TOKENS) :])
        self._read = 0
        self._prefix_text = ""
        self._advance(self._decode(self._window))
        self._stops = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        # Final text held back because it may be the start of a stop string.
        self._held = ""
        # With the stop string included nothing is held back, so the end of the text already
        # returned (too short to hold a whole stop string) is kept to find a stop that began in it.
        self._tail = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared; later pushes return nothing."""
        return self._stopped

    def push(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        """Adds generated tokens; returns the text that became final and any stop string hit."""
        released: list[str] = []
        for pushed, token_id in enumerate(new_token_ids, start=1):
            if self._stopped:
                break
            # Stop strings are checked token by token so that the outcome does not depend on
            # how the tokens were grouped into pushes.
            self._num_tokens += 1
            text = self._push_token(token_id)
            text, stop_string = self._release(text) if self._num_tokens >= self._min_tokens else (text, None)
            released.append(text)
            if stop_string is not None:
                return DetokenizerStep("".join(released), StringStop(stop_string, pushed))
        return DetokenizerStep("".join(released))

    def flush(self) -> str:
        """Returns all text still held back, less an incomplete last character; call once when
        the request ends for another reason.

        Text up to a stop string found only now is returned, the stop string and what follows it
        are not (the request ended anyway, so there is no stop to report).
        """
        if self._stopped:
            return ""
        text = self._held
        self._held = ""
        if self._read < len(self._window):
            window_text = self._decode(self._window)
            # Held tokens end in a character whose remaining bytes were never generated (a
            # length or stop limit cut it off): those bytes are no text, so they are dropped
            # rather than returned as replacement characters, as vLLM does.
            text += window_text[len(self._prefix_text) :].rstrip(REPLACEMENT_CHAR)
            self._advance(window_text)
        if self._stops:
            searched = self._tail + text
            position, stop_string = self._find_stop(searched)
            if stop_string is not None:
                self._stopped = True
                return searched[len(self._tail) : self._stop_end(position, stop_string)]
        return text

    def _push_token(self, token_id: int) -> str:
        self._window.append(token_id)
        new_text = self._decode(self._window)
        within_hold_limit = len(self._window) - self._read <= MAX_HELD_TOKENS
        # A trailing replacement char is usually a character whose remaining bytes are in the
        # next tokens; no growth means the token produced no text (a skipped special token) and
        # keeping it in the window keeps the context for the next one.
        if within_hold_limit and (
            new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(self._prefix_text)
        ):
            return ""
        if not within_hold_limit:
            logger.debug("releasing %d undecodable tokens", len(self._window) - self._read)
        delta = new_text[len(self._prefix_text) :]
        self._advance(new_text)
        return delta

    def _advance(self, window_text: str) -> None:
        """Marks the window (which decodes to window_text) returned; keeps its last few tokens.

        The kept tokens must decode to the end of window_text on their own, or the next diff is
        taken against the wrong text: a cut inside a character (a byte-level or byte-fallback
        split) fails that, so earlier cut points are tried.
        """
        self._read = len(self._window)
        self._prefix_text = window_text
        latest_cut = len(self._window) - CONTEXT_TOKENS
        for cut in range(latest_cut, max(latest_cut - CUT_SEARCH_TOKENS, 0), -1):
            tail_text = self._decode(self._window[cut:])
            # Empty context (only skipped special tokens) would lose a following token's
            # leading space in SentencePiece-style tokenizers.
            if (tail_text or not window_text) and window_text.endswith(tail_text):
                self._cut(cut, tail_text)
                return
        if len(self._window) > MAX_WINDOW_TOKENS:
            self._cut(latest_cut, self._decode(self._window[latest_cut:]))

    def _cut(self, cut: int, tail_text: str) -> None:
        del self._window[:cut]
        self._read = len(self._window)
        self._prefix_text = tail_text

    def _release(self, text: str) -> tuple[str, str | None]:
        """Applies stop strings to newly final text: the text to stream now, and the stop string
        that ended the output, if one appeared."""
        if not self._stops:
            return text, None
        # Any stop string that began in text returned earlier would have kept its start held
        # back (or in the tail), so searching it plus the new text finds every match.
        searched = self._tail + self._held + text
        position, stop_string = self._find_stop(searched)
        if stop_string is not None:
            self._stopped = True
            self._held = ""
            return searched[len(self._tail) : self._stop_end(position, stop_string)], stop_string
        if self._include_stop:
            self._tail = searched[max(len(searched) - self._max_stop_len + 1, 0) :]
            return text, None
        keep = self._possible_stop_start(searched)
        self._held = searched[len(searched) - keep :]
        return searched[: len(searched) - keep], None

    def _stop_end(self, position: int, stop_string: str) -> int:
        """Where the returned text ends for a stop string found at position."""
        return position + len(stop_string) if self._include_stop else position

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        """Position and value of the stop string in text that ends first.

        Ending first is what a token-by-token generator would have stopped on; where several end
        together, the one that starts first (the longest) wins.
        """
        best: tuple[int, int, str] | None = None
        for stop_string in self._stops:
            position = text.find(stop_string)
            if position < 0:
                continue
            candidate = (position + len(stop_string), position, stop_string)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return len(text), None
        return best[1], best[2]

    def _possible_stop_start(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(stop_string.startswith(suffix) for stop_string in self._stops):
                return length
        return 0
