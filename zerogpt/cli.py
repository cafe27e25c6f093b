"""How zerogpt's command-line tools print --help: their docstring as written, and every option's default."""
from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the description's line breaks (usage examples) and append "(default: X)" to each option's help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # a help text that already states its default keeps it; flags and unset options (None) need none
        if "default" in (action.help or "") or action.default in (None, False):
            return action.help
        return super()._get_help_string(action)
