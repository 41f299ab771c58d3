"""The `--help` of every splitserve command: each flag's help ends with its default, where it
has one worth showing (not None, not required, not a switch)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, argparse.SUPPRESS) or action.required or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)
