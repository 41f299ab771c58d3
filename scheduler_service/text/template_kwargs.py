"""Caller-chosen chat template variables (vLLM's chat_template_kwargs), checked before any
rendering: a few plain values under names the server does not set itself.

The template renders whatever it is given, and transformers lets these variables override its
own arguments and the special tokens it passes in (eos_token, ...): a caller naming
`add_generation_prompt` or `messages` would rewrite the conversation, and `tokenize` or
`return_dict` would change what the call returns. So every name the call or the template
already uses is refused, not only the few a template is known to read.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TemplateValue = bool | int | float | str

MAX_TEMPLATE_KWARGS = 32
# UTF-8 bytes of every name and string value together: templates take switches and short
# settings, not documents (a prompt belongs in the messages, under the prompt caps).
MAX_TEMPLATE_KWARGS_BYTES = 4096
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
# What transformers' template rendering sets beside the call's own parameters: the conversation
# and the helper functions templates call.
TEMPLATE_GLOBALS = frozenset({"messages", "conversation", "raise_exception", "strftime_now"})
# Every special-token variable, also those this tokenizer leaves unset: a template may print
# `bos_token` whether or not it is defined.
SPECIAL_TOKEN_NAMES = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
     "additional_special_tokens"}
)


class TemplateKwargsError(ValueError):
    """Template variables the server will not pass to the chat template; says which and why."""


def reserved_template_names(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """Names a caller may not set: apply_chat_template's parameters, the template's globals and
    the special-token variables (bos_token, eos_token, ...) it fills in from the tokenizer."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    named = {name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(named | TEMPLATE_GLOBALS | SPECIAL_TOKEN_NAMES | set(tokenizer.special_tokens_map))


def checked_template_kwargs(
    kwargs: Mapping[str, TemplateValue], reserved: frozenset[str]
) -> dict[str, TemplateValue]:
    """The variables as the template gets them; TemplateKwargsError naming the first problem."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise TemplateKwargsError(
            f"chat_template_kwargs has {len(kwargs)} entries; at most {MAX_TEMPLATE_KWARGS} are allowed"
        )
    size = 0
    for name, value in kwargs.items():
        shown = name if len(name) <= 64 else name[:64] + "..."
        if NAME_PATTERN.fullmatch(name) is None:
            raise TemplateKwargsError(
                f"chat_template_kwargs name {shown!r} is not an identifier (a letter, then up to 63 "
                "letters, digits or underscores)"
            )
        if name in reserved:
            raise TemplateKwargsError(
                f"chat_template_kwargs may not set {name!r}: the server sets it (reserved: "
                f"{', '.join(sorted(reserved))})"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise TemplateKwargsError(f"chat_template_kwargs {name!r} is {value}; numbers must be finite")
        if not isinstance(value, (bool, int, float, str)):
            raise TemplateKwargsError(
                f"chat_template_kwargs {name!r} is a {type(value).__name__}; values must be "
                "booleans, numbers or strings"
            )
        size += len(name) + (len(value.encode()) if isinstance(value, str) else 0)
        if size > MAX_TEMPLATE_KWARGS_BYTES:
            raise TemplateKwargsError(
                f"chat_template_kwargs are longer than {MAX_TEMPLATE_KWARGS_BYTES} bytes of names "
                "and strings together"
            )
    return dict(kwargs)
