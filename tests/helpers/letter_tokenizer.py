"""A tokenizer for the tests' tiny-vocabulary models: <unk>, <s>, </s> (ids 0, 1, 2: the model
factory's BOS 1 and EOS 2), then one lowercase letter per id, so a model with a 16-token
vocabulary writes text in a..m and the scheduler can apply structured outputs and stop strings
to it.

    folder = letter_tokenizer_dir(tmp_path / "tokenizer", vocab_size=16)   # --tokenizer folder
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>"]


def letter_tokenizer_dir(target: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    letters = string.ascii_lowercase[: vocab_size - len(SPECIALS)]
    assert len(SPECIALS) + len(letters) == vocab_size, f"at most {len(SPECIALS) + 26} tokens"
    pieces = SPECIALS + list(letters)
    backend = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[], unk_token="<unk>"))
    # Letters join without spaces.
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )
    tokenizer.save_pretrained(target)
    return target
