"""What a tokenizer folder must hold, checked before transformers is asked to load it: its own
refusals of a local folder talk of the hub, connections and slow-tokenizer conversion."""

from __future__ import annotations

from pathlib import Path

from service_support.local_folder import FolderError, require_folder

TOKENIZER_FOLDER_HOLDS = (
    "tokenizer.json (or vocab.json and merges.txt, or a SentencePiece tokenizer.model), as "
    "save_pretrained writes them; a model folder usually holds its tokenizer"
)
# Every tokenizer transformers builds reads its vocabulary from one of these.
_VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken", "tekken.json")


def check_tokenizer_folder(folder: Path) -> None:
    """Raises FolderError, saying what is missing, unless folder holds a vocabulary."""
    require_folder(folder, TOKENIZER_FOLDER_HOLDS)
    if not any(any(folder.glob(pattern)) for pattern in _VOCABULARY_FILES):
        raise FolderError(f"{folder}: holds no tokenizer files; a tokenizer folder holds {TOKENIZER_FOLDER_HOLDS}")


def unloadable(folder: Path, error: Exception) -> FolderError:
    """The refusal of a folder that has tokenizer files transformers still cannot load (a
    broken JSON file, a tokenizer class it lacks): its first line says which."""
    first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return FolderError(f"{folder}: transformers cannot load its tokenizer ({type(error).__name__}: {first_line})")
