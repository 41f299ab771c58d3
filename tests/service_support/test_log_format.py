"""--log-format json: each event line becomes one JSON object whose fields are the message's
key=value pairs, values typed back (quoted strings unquoted, numbers as numbers)."""

from __future__ import annotations

import json
import logging
import sys

from service_support.log_format import JsonFormatter, message_fields


def test_fields_come_back_typed() -> None:
    message = "event=request_failed request_id=abc-1 tokens=12 share=0.25 reason='it broke: \"x\" y' empty=''"
    assert message_fields(message) == {
        "event": "request_failed",
        "request_id": "abc-1",
        "tokens": 12,
        "share": 0.25,
        "reason": 'it broke: "x" y',
        "empty": "",
    }


def test_a_record_is_one_json_line_with_its_fields_and_exception() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.LogRecord(
            "scheduler_service", logging.ERROR, __file__, 1, "event=step_failed step_id=%d", (7,), True
        )
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["event"] == "step_failed" and entry["step_id"] == 7
    assert entry["level"] == "ERROR" and entry["logger"] == "scheduler_service"
    assert "ValueError: bad" in entry["exception"]
