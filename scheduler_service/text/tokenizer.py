"""Text <-> token ids for the scheduler: prompts, chats, token pieces and EOS ids.

Pure tokenizer work (no model, no torch of our own): the scheduler tokenizes on the CPU while the
executors own the model.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from scheduler_service.text.template_kwargs import (
    TemplateValue,
    checked_template_kwargs,
    reserved_template_names,
)
from scheduler_service.text.token_bytes import TokenBytes
from scheduler_service.text.token_count_bound import token_count_bound
from scheduler_service.text.tokenizer_folder import check_tokenizer_folder, unloadable
from scheduler_service.text.tool_prompt import (
    hermes_conversation,
    template_renders_tools,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A chat turn as a (role, content) pair or as {"role": ..., "content": ...}, the mapping with
# transformers' optional tool keys: "tool_calls" ([{"id", "type": "function", "function": {"name",
# "arguments": object}}]), "tool_call_id" and "name".
ChatTurn = tuple[str, str] | Mapping[str, Any]
# A tool as transformers takes it: {"type": "function", "function": {"name", "description",
# "parameters"}}.
ToolSpec = Mapping[str, Any]


class ChatContentError(ValueError):
    """A chat that cannot be tokenized without letting its messages write control tokens."""


class TextProcessor:
    """Wraps one Hugging Face tokenizer with the operations the scheduler service needs."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        eos = set(extra_eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self._eos_token_ids = tuple(sorted(eos))
        # Control tokens: every added token, not only those marked special. Qwen3's <think>,
        # <tool_call> and <|fim_prefix|> are added but not special, and a client that could
        # write them would close a reasoning block or forge a tool call.
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._control_ids = frozenset(added).union(tokenizer.all_special_ids)
        # Longest first, so that a control token containing another one is matched whole.
        controls = set(added.values()).union(tokenizer.all_special_tokens)
        by_length = sorted(controls, key=len, reverse=True)
        self._control_text = re.compile("|".join(map(re.escape, by_length)) or "(?!)")
        self._plain_backend = _plain_text_backend(tokenizer)
        self._token_count_bound = token_count_bound(tokenizer)
        self._reserved_template_names = reserved_template_names(tokenizer)
        # Each token's bytes, for logprobs.
        self.token_bytes = TokenBytes(tokenizer)

    @classmethod
    def from_pretrained(cls, tokenizer_dir: str | Path) -> TextProcessor:
        """Loads the tokenizer of a local model folder (no hub access is ever attempted); a
        folder that holds none raises FolderError saying what is missing.

        EOS ids also come from the folder's generation_config.json when it has one: chat models
        often end turns with a token the tokenizer does not call EOS (Qwen's <|im_end|>).
        """
        # Imported here, as every transformers import of the text modules: transformers' auto
        # classes import torch where it is installed and transformers has not been told it is
        # absent, a second or more of start-up and ~240 MB; a scheduler without a tokenizer
        # never pays it, and a front-end rules torch out first (process/torch_free.py).
        from transformers import AutoTokenizer

        folder = Path(tokenizer_dir)
        check_tokenizer_folder(folder)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as error:
            # Whatever transformers trips on in a folder of the user's (broken JSON, a missing
            # key, a class it lacks) is a refusal of that folder, not a crash of the scheduler.
            raise unloadable(folder, error) from error
        processor = cls(tokenizer, _generation_eos_ids(folder))
        logger.info(
            "event=tokenizer_loaded class=%s folder=%s vocab=%d eos=%s chat_template=%s",
            type(tokenizer).__name__,
            folder,
            len(tokenizer),
            ",".join(map(str, processor.eos_token_ids)),
            processor.has_chat_template,
        )
        return processor

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, with the special tokens the tokenizer adds (BOS, if any)."""
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def fewest_tokens(self, text: str) -> int:
        """A number of tokens encode(text) certainly reaches, found without encoding: 0 for a
        tokenizer that no text length bounds (text/token_count_bound.py)."""
        bound = self._token_count_bound
        return 0 if bound is None else bound.fewest_tokens(text)

    def encode_chat(
        self,
        messages: Sequence[ChatTurn],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, TemplateValue] | None = None,
        tools: Sequence[ToolSpec] = (),
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template.

        The template writes its own special tokens (BOS included where the model wants one), so
        the rendered text is encoded without adding more. Control-token strings (any added token,
        special or not) that a client writes in a message's content are encoded as plain text:
        they could otherwise end a turn and forge the next one. template_kwargs are extra
        template variables (TemplateKwargsError, a ValueError, for those refused; see
        text/template_kwargs.py).

        tools, and turns' calls and results, go to a template that renders tools as they are;
        for any other template they are written into plain turns (text/tool_prompt.py). Their
        strings are rendered as JSON or verbatim where no stand-in could quote a control token,
        so one that holds a control token's text is refused (ChatContentError).
        """
        if not self.has_chat_template:
            raise ValueError("the tokenizer has no chat template")
        variables = checked_template_kwargs(template_kwargs or {}, self._reserved_template_names)
        # A template may print a variable or a role anywhere, where no stand-in could quote it.
        for value in variables.values():
            if isinstance(value, str) and (found := self._control_text.search(value)):
                raise ChatContentError(f"a chat_template_kwargs string contains {_control_token(found)}")
        conversation = [_as_dict(turn) for turn in messages]
        for turn in conversation:
            if found := self._control_text.search(turn["role"]):
                raise ChatContentError(f"a message role contains {_control_token(found)}")
            for key in ("tool_calls", "tool_call_id", "name"):
                self._refuse_control_text(turn.get(key), f"a message's {key}")
        for tool in tools:
            self._refuse_control_text(tool, "a tool definition")
        template_tools: list[ToolSpec] | None = list(tools) or None
        with_tools = tools or any(turn.get("tool_calls") or turn["role"] == "tool" for turn in conversation)
        if with_tools and not template_renders_tools(self._tokenizer.chat_template):
            conversation, template_tools = hermes_conversation(conversation, tools), None
        if any(self._control_text.search(turn["content"]) for turn in conversation):
            return self._encode_chat_quoting_controls(conversation, add_generation_prompt, variables, template_tools)
        rendered = self._render_chat(conversation, add_generation_prompt, variables, template_tools)
        return list(self._tokenizer.encode(rendered, add_special_tokens=False))

    def _refuse_control_text(self, value: Any, what: str) -> None:
        for text in _strings(value):
            if found := self._control_text.search(text):
                raise ChatContentError(f"{what} contains {_control_token(found)}")

    def _encode_chat_quoting_controls(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, TemplateValue],
        tools: list[ToolSpec] | None,
    ) -> list[int]:
        """encode_chat for contents that hold control-token strings.

        Before rendering, each such string is swapped for a stand-in: a random key the client
        cannot guess, in hex digits, which the filters templates apply to text (trim, escape,
        tojson) leave whole and which cannot hold or complete a control token (those are spelled
        with punctuation). Every control token in the rendered text was therefore written by the
        template, and whatever the template does with a content (trim it, drop it, repeat it), a
        stand-in stays one client's string. A template that looks into contents for control
        tokens (Qwen3's moves what precedes a '</think>' into a reasoning block) sees none of the
        client's. The tokenizer splits its input at added tokens before it normalizes or merges
        anything, so each stretch between two of them is encoded on its own anyway: the
        stretches holding a stand-in are encoded again with the client's strings put back and
        added-token parsing off; the others keep the ids they get without stand-ins.
        (SentencePiece tokenizers that mark only the start of the whole text with a space also
        mark a re-encoded stretch: a text difference, never a control token.)
        """
        plain = self._plain_backend
        if plain is None:
            raise ChatContentError(
                "messages contain special or added tokens, which this tokenizer cannot encode as text"
            )
        key = secrets.token_hex(16)
        originals: dict[str, str] = {}

        def stand_in(match: re.Match[str]) -> str:
            name = f"{key}{len(originals)}{key}"
            originals[name] = match.group()
            return name

        marked = [{**turn, "content": self._control_text.sub(stand_in, turn["content"])} for turn in conversation]
        rendered = self._render_chat(marked, add_generation_prompt, variables, tools)
        stand_ins = re.compile(f"{key}\\d+{key}")
        found = stand_ins.findall(rendered)
        if rendered.count(key) != 2 * len(found) or not originals.keys() >= set(found):
            # The template cut or rewrote a stand-in: refuse rather than guess what it held.
            raise ChatContentError(
                "the chat template rewrites message contents that hold special or added tokens"
            )

        def stretch(start: int, end: int, encoded: list[int]) -> list[int]:
            text = rendered[start:end]
            if key not in text:
                return encoded
            text = stand_ins.sub(lambda match: originals[match.group()], text)
            quoted = plain.encode(text, add_special_tokens=False).ids
            if not self._control_ids.isdisjoint(quoted):
                # A vocabulary that merges plain text into a control token: no way to quote it.
                raise ChatContentError("a message holds a control token the tokenizer cannot quote")
            return quoted

        encoding = self._tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        pending: list[int] = []
        pending_start = 0
        for token_id, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"]):
            if token_id not in self._control_ids:
                pending.append(token_id)
                continue
            # A control token's offsets include the whitespace it strips (lstrip, rstrip).
            ids += stretch(pending_start, start, pending)
            ids.append(token_id)
            pending, pending_start = [], end
        return ids + stretch(pending_start, len(rendered), pending)

    def _render_chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, TemplateValue],
        tools: list[ToolSpec] | None,
    ) -> str:
        rendered = self._tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **variables
        )
        if not isinstance(rendered, str):
            raise TypeError(f"chat template rendered {type(rendered).__name__}, expected str")
        return rendered

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level tokenizers show bytes as symbols, e.g. 'Ġ')."""
        return list(self._tokenizer.convert_ids_to_tokens(list(ids)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _control_token(found: re.Match[str]) -> str:
    return f"{found.group()!r}, a special token or added token of the tokenizer"


def _as_dict(turn: ChatTurn) -> dict[str, Any]:
    if isinstance(turn, tuple):
        role, content = turn
        return {"role": role, "content": content}
    return dict(turn)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _plain_text_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """A copy of a fast tokenizer's backend that encodes every added token's string as text.

    A copy of its own, since split_special_tokens=True sets a flag on the shared backend for
    the length of a call, and a call on another thread can set it back meanwhile.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    plain = copy.deepcopy(backend)
    # encode_special_tokens spells out only the added tokens marked special: the others are
    # marked so here (same ids, same matching), which re-adding an existing token does.
    plain.add_special_tokens(
        [
            AddedToken(
                token.content,
                single_word=token.single_word,
                lstrip=token.lstrip,
                rstrip=token.rstrip,
                normalized=token.normalized,
                special=True,
            )
            for token in plain.get_added_tokens_decoder().values()
            if not token.special
        ]
    )
    plain.encode_special_tokens = True
    plain.no_truncation()
    plain.no_padding()
    return plain


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]
