"""deploy/make_certs.py's certificates for a test, made as a user makes them (the script, in a
process of its own) into a folder of the test's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.service_process import REPO_ROOT

MAKE_CERTS = REPO_ROOT / "deploy" / "make_certs.py"


def issue_certs(out: Path, *args: str) -> Path:
    """out, holding the CA, the leaves and the API key; args: the script's flags."""
    made = subprocess.run(
        [sys.executable, str(MAKE_CERTS), str(out), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return out
