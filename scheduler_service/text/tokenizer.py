"""Text <-> token ids for the scheduler: prompts, chats, token pieces and EOS ids.

Pure tokenizer work (no model, no torch of our own): the scheduler tokenizes on the CPU while the
executors own the model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A chat turn as a (role, content) pair or as {"role": ..., "content": ...}.
ChatTurn = tuple[str, str] | Mapping[str, str]


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

    @classmethod
    def from_pretrained(cls, tokenizer_dir: str | Path) -> TextProcessor:
        """Loads the tokenizer of a local model folder (no hub access is ever attempted).

        EOS ids also come from the folder's generation_config.json when it has one: chat models
        often end turns with a token the tokenizer does not call EOS (Qwen's <|im_end|>).
        """
        folder = Path(tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        processor = cls(tokenizer, _generation_eos_ids(folder))
        logger.info(
            "loaded tokenizer %s from %s (vocab %d, eos %s, chat template %s)",
            type(tokenizer).__name__,
            folder,
            len(tokenizer),
            list(processor.eos_token_ids),
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

    def encode_chat(self, messages: Sequence[ChatTurn], add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation rendered with the chat template.

        The template writes its own special tokens (BOS included where the model wants one), so
        the rendered text is encoded without adding more.
        """
        if not self.has_chat_template:
            raise ValueError("the tokenizer has no chat template")
        conversation = [_as_dict(turn) for turn in messages]
        rendered = self._tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        if not isinstance(rendered, str):
            raise TypeError(f"chat template rendered {type(rendered).__name__}, expected str")
        return list(self._tokenizer.encode(rendered, add_special_tokens=False))

    def token_pieces(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level tokenizers show bytes as symbols, e.g. 'Ġ')."""
        return list(self._tokenizer.convert_ids_to_tokens(list(ids)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _as_dict(turn: ChatTurn) -> dict[str, str]:
    if isinstance(turn, tuple):
        role, content = turn
        return {"role": role, "content": content}
    return {"role": turn["role"], "content": turn["content"]}


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]
