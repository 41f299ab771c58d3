"""Logging for every splitserve service: one line per event, as `key=value` text (the default)
or, with `--log-format json`, as one JSON object per line for log pipelines.

Messages are written as `event=name key=value ...` (values that may hold spaces as Python
reprs); the JSON form parses them back into fields, so `request_id`, `executor` and the rest are
queryable without a grok pattern.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import re
import sys
import time

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
# key=value where the value is a quoted Python repr or runs to the next space.
FIELD = re.compile(r"""(\w+)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)""")


def message_fields(message: str) -> dict[str, object]:
    """The key=value fields of a message; quoted values unquoted, numbers as numbers."""
    fields: dict[str, object] = {}
    for key, raw in FIELD.findall(message):
        value: object = raw
        if raw[:1] in ("'", '"'):
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
        elif re.fullmatch(r"-?\d+", raw):
            value = int(raw)
        elif re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", raw):
            value = float(raw)
        fields[key] = value
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            **message_fields(message),
            "message": message,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def add_log_format_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format", choices=FORMATS, default="text", help="text: key=value lines; json: one JSON object per line"
    )


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Root logging to stderr in the chosen format (UTC timestamps in JSON)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[handler], force=True)
