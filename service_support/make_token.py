"""`splitserve executor-token FILE`: writes a new random executor token into FILE (mode 0600)
unless FILE already holds a valid one, which is kept, so a one-shot that runs at every start
(docker compose) gives restarted services the token they had. Both the executors and the
scheduler then take `--executor-token-file FILE`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from protos.executor_access import TokenFileError, read_token_file, write_token_file
from service_support.cli_help import DefaultsHelpFormatter

logger = logging.getLogger("service_support.make_token")


def main(argv: Sequence[str] | None = None, prog: str = "python -m service_support.make_token") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("file", type=Path, metavar="FILE", help="where the token goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="level=%(levelname)s logger=%(name)s %(message)s")
    if args.file.exists():
        try:
            read_token_file(args.file)
        except TokenFileError as error:
            logger.error("event=token_refused reason=%r", f"{error}; remove it to have a new one written")
            return 2
        logger.info("event=token_kept path=%s", args.file)
        return 0
    try:
        args.file.parent.mkdir(parents=True, exist_ok=True)
        write_token_file(args.file)
    except OSError as error:
        logger.error("event=token_refused reason=%r", f"cannot write {args.file}: {error}")
        return 2
    logger.info("event=token_written path=%s", args.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
