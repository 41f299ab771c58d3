"""What both ends of the Executor API agree on about who may drive an executor: the metadata key
of the shared token, how a token file is read, and the scheduler name deploy/make_certs.py issues
(the default of the executor's --allowed-scheduler-names)."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

# Metadata key carrying the shared secret of --executor-token-file on every Executor API call.
EXECUTOR_TOKEN_METADATA = "x-splitserve-executor-token"
# ExecutorInfo.access of an executor that checks nothing (--insecure-executor).
INSECURE_ACCESS = "insecure"
# The common name of the client certificate make_certs issues for schedulers.
DEFAULT_SCHEDULER_NAME = "splitserve-scheduler"
# A token guessable in a lifetime of tries is no lock: 16 characters of a random alphabet are
# 80+ bits; write_token_file() writes 43.
MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """A token file that cannot serve: missing, empty, too short or not printable ASCII."""


def read_token_file(path: Path) -> str:
    """The token: the file's first line, stripped. A file others may read is used but logged,
    since whoever reads it may drive the executors."""
    try:
        text = path.read_text(encoding="ascii")
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise TokenFileError(f"--executor-token-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TokenFileError(f"--executor-token-file {path}: cannot read it as ASCII text ({error})") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(
            f"--executor-token-file {path}: the token must be at least {MIN_TOKEN_CHARS} characters "
            f"on its first line (got {len(token)}); e.g. `python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))' > {path}`"
        )
    if not token.isprintable() or " " in token:
        raise TokenFileError(f"--executor-token-file {path}: the token must be printable ASCII without spaces")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning(
            "event=token_file_readable path=%s mode=%o advice='chmod 600: whoever reads it may drive executors'",
            path, stat.S_IMODE(mode),
        )
    return token


def write_token_file(path: Path) -> str:
    """A new random token in a new file only its owner can read (O_EXCL: never over another)."""
    token = secrets.token_urlsafe(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(token + "\n")
    return token
