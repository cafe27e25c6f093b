"""How zerogpt's command-line tools print --help: their docstring as written, and every option's default."""
from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the description's line breaks (usage examples) and append "(default: X)" to each option's help."""
