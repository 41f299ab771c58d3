"""A draft model for speculative decoding cut from a model itself: its first layers, with its
embedding, final norm and head (the same vocabulary, by construction).

    python -m executor_service.truncated_draft MODEL_DIR DRAFT_DIR --layers 4

The draft's answers are those of the model's early layers read through its head: a cheap guess
that is often the model's own token on text that follows from what came before (a quote, code
being edited), which is where speculation pays. Serve it with `--draft-model DRAFT_DIR` beside
`--model MODEL_DIR` and the scheduler's `--speculative-method draft`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

# Per-layer weights of decoder-only models in transformers: model.layers.<i>.…
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Per-layer lists in a config, cut with the layers.
_LAYER_LISTS = ("layer_types",)
_WEIGHTS = "model.safetensors"


def truncate(model_dir: Path, draft_dir: Path, layers: int) -> Path:
    """Writes the draft into draft_dir (created) and returns it."""
    config = json.loads((model_dir / "config.json").read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ValueError(f"{model_dir}/config.json has no num_hidden_layers")
    if not 0 < layers < total:
        raise ValueError(f"--layers must be between 1 and {total - 1} (the model has {total})")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    kept = {}
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                match = _LAYER.search(name)
                if match is None or int(match.group(1)) < layers:
                    kept[name] = weights.get_tensor(name)
    draft_dir.mkdir(parents=True, exist_ok=True)
    config["num_hidden_layers"] = layers
    for key in _LAYER_LISTS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(draft_dir / _WEIGHTS), metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.suffix != ".safetensors" and path.name not in ("config.json", f"{_WEIGHTS}.index.json"):
            shutil.copy2(path, draft_dir / path.name)
    logger.info("event=draft_written model=%s draft=%s layers=%d of=%d tensors=%d", model_dir, draft_dir, layers, total, len(kept))
    return draft_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="the model's local folder (config.json, *.safetensors)")
    parser.add_argument("draft_dir", type=Path, help="where to write the draft")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps, the first ones")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        truncate(args.model_dir, args.draft_dir, args.layers)
    except ValueError as error:
        logger.error("event=draft_refused reason=%r", str(error))
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
