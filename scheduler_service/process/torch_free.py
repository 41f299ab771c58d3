"""A front-end process never loads torch.

A front-end tokenizes, detokenizes and streams; it runs no model and compiles no grammar (its
planner does both). Yet transformers' AutoTokenizer imports its configuration module, which
imports torch wherever torch is installed: ~240 MB of resident memory and a second or two of
start-up in every front-end, for nothing. Marking torch absent before transformers first loads
makes transformers take its tokenizers-only path (which it supports: an install of transformers
and tokenizers without torch), with the same token ids, text and chat prompts
(tests/scheduler/test_torch_free.py checks that). So the scheduler's text modules import
transformers only when a tokenizer loads, never at import.
"""

import logging
import sys

logger = logging.getLogger(__name__)


def forbid_torch() -> bool:
    """Makes every later `import torch` in this process fail and transformers see no torch;
    False (and nothing changed) where transformers or torch is loaded already (a test calling the
    scheduler's main() in its own process): transformers has decided then that torch is there."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        logger.info("event=torch_kept reason='transformers or torch was imported before the front-end started'")
        return False
    # None in sys.modules is Python's own mark of a module that must not be imported:
    # importlib.util.find_spec (transformers' check) answers None for it, and an import raises
    # ImportError.
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True
