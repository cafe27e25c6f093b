"""Every console script in setup.py names a `main` that imports, and `python -m zerogpt_tools.<name> --help` runs."""
import importlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = re.findall(r'"(zerogpt-[\w-]+)=([\w.]+):(\w+)"', open(os.path.join(ROOT, "setup.py")).read())


def test_every_tool_has_a_console_script():
    tools = {module for _, module, _ in SCRIPTS if module.startswith("zerogpt_tools.")}
    assert tools == {"zerogpt_tools.export", "zerogpt_tools.generate", "zerogpt_tools.estimate",
                     "zerogpt_tools.extend_vocab", "zerogpt_tools.import_megatron"}


@pytest.mark.parametrize("script, module, func", SCRIPTS)
def test_console_script_target_imports(script, module, func):
    assert callable(getattr(importlib.import_module(module), func)), script


@pytest.mark.timeout(120)
def test_python_m_help_runs():
    res = subprocess.run([sys.executable, "-m", "zerogpt_tools.estimate", "--help"], capture_output=True,
                         text=True, cwd=ROOT, timeout=100)
    assert res.returncode == 0 and "python -m zerogpt_tools.estimate" in res.stdout
