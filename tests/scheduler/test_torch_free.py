"""A front-end loads its tokenizer with torch ruled out (process/torch_free.py), and the tokenizer
it gets answers as the one loaded with torch does: token ids (control-token text included),
text, EOS ids, chat prompts (with tools where the template renders them), token pieces and
bytes, and the token-count bound. Each side runs in a process of its own, as a front-end does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.letter_tokenizer import letter_tokenizer_dir
from tests.helpers.tenant_stack import chat_tokenizer_dir
from tests.helpers.tokenizer_assets import qwen3_tokenizer_dir

PROBE = r"""
import json, sys
from scheduler_service.process.torch_free import forbid_torch
ruled_out = forbid_torch() if sys.argv[1] == "without" else False
from scheduler_service.text.tokenizer import TextProcessor
samples = ["Hello, world!", "naive café, Tōkyō 東京 🚀", "  two spaces\nnew line\ttab", "<|im_end|><s></s> from a client"]
tool = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
answers = {}
for folder in sys.argv[2:]:
    text = TextProcessor.from_pretrained(folder)
    answer = {
        "eos": list(text.eos_token_ids),
        "ids": [text.encode(sample) for sample in samples],
        "fewest": [text.fewest_tokens(sample) for sample in samples],
    }
    ids = [i for encoded in answer["ids"] for i in encoded]
    answer["text"] = [text.decode(ids, skip_special_tokens=skip) for skip in (True, False)]
    answer["pieces"] = text.token_pieces(ids)
    answer["bytes"] = [text.token_bytes(i).hex() for i in ids]
    if text.has_chat_template:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": samples[3]}]
        answer["chat"] = text.encode_chat(chat, add_generation_prompt=True)
        answer["chat_tools"] = text.encode_chat(chat, add_generation_prompt=True, tools=[tool])
    answers[folder] = answer
print(json.dumps({"ruled_out": ruled_out, "torch_loaded": sys.modules.get("torch") is not None, "answers": answers}))
"""


def probe(torch: str, folders: list[Path]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, torch, *map(str, folders)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_tokenizers_loaded_without_torch_answer_as_with_it(tmp_path: Path, prepared_model: Path) -> None:
    folders = [
        chat_tokenizer_dir(tmp_path / "gpt2"),
        qwen3_tokenizer_dir(),
        letter_tokenizer_dir(tmp_path / "letters", vocab_size=16),
        prepared_model,
    ]
    without, with_torch = probe("without", folders), probe("with", folders)
    assert without["ruled_out"] is True and without["torch_loaded"] is False
    # The comparison means something: the same loads with torch allowed do load it.
    assert with_torch["ruled_out"] is False and with_torch["torch_loaded"] is True
    for folder in map(str, folders):
        assert without["answers"][folder] == with_torch["answers"][folder], folder
    # Every folder but the letters' has a chat template, so chats were compared too.
    assert ["chat" in answer for answer in without["answers"].values()] == [True, True, False, True]


def test_torch_is_kept_where_transformers_came_first() -> None:
    """A front-end run in a process that imported transformers already (tests that call main
    in process) keeps torch rather than breaking the transformers that thought it there."""
    code = (
        "import sys, transformers\n"
        "from scheduler_service.process.torch_free import forbid_torch\n"
        "print(forbid_torch(), 'torch' in sys.modules and sys.modules['torch'] is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "False"]
