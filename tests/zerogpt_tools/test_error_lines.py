"""Every tool's bad input ends in exactly one line, `error: <what and the fix>`, and nothing around it (issue 48.6).

One case per command a user runs: each zerogpt_tools module, the data pipeline's CLI and train_gpt.py, each in
its own process (the whole output is what a user sees), all started at once so the imports overlap.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINT_FIX = "pass e.g. runs/x or runs/x/checkpoints/step_1000"


def cases(tmp: str) -> dict[str, tuple[list[str], str]]:
    """name -> (argv after `python`, the one line it must print)."""
    none = os.path.join(tmp, "none")
    not_a_run = (f"error: {none} is neither a checkpoint directory (no meta.json) nor a run directory (no "
                 f"checkpoints/latest); {CHECKPOINT_FIX}")
    return {
        "export": (["-m", "zerogpt_tools.export", none, "--out", f"{tmp}/o1"], not_a_run),
        "export --format megatron": (["-m", "zerogpt_tools.export", none, "--format", "megatron", "--out",
                                      f"{tmp}/o2"], not_a_run),
        "import_megatron": (["-m", "zerogpt_tools.import_megatron", none, "--out", f"{tmp}/run"],
                            f"error: {none} is not a Megatron checkpoint: no latest_checkpointed_iteration.txt and "
                            f"not an iter_N or release directory; pass the directory Megatron's --save wrote"),
        "generate": (["-m", "zerogpt_tools.generate", "--model", none, "--prompt", "x"],
                     f"error: --model {none}: no such directory (an exported HF dir, a run dir or a checkpoint dir)"),
        "extend_vocab": (["-m", "zerogpt_tools.extend_vocab", "--model", none, "--tokenizer", none, "--out",
                          f"{tmp}/o3"],
                         f"error: --model {none}: no config.json there; point at a Hugging Face directory of a GPT-2 "
                         f"(e.g. `python -m zerogpt_tools.export RUN --out DIR` output) or a Llama-family model"),
        "estimate": (["-m", "zerogpt_tools.estimate", "--model", "gpt2_tiny", "--world", "3", "--nodes", "2"],
                     "error: --world 3 must be a multiple of --nodes 2"),
        "data_pipeline": (["-m", "data_pipeline", "tokenize", f"{none}.jsonl", "--tokenizer", none,
                           "--output-prefix", f"{tmp}/o4"],
                          f"error: input '{none}.jsonl' does not exist; check the path (or run the previous stage)"),
        "train_gpt.py": (["train_gpt.py", "--config", f"{none}.py"], f"error: config file '{none}.py' does not exist"),
    }


@pytest.mark.timeout(300)
def test_each_tools_bad_input_is_one_error_line(tmp_path):
    runs = {name: subprocess.Popen([sys.executable, *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
            for name, (argv, _) in cases(str(tmp_path)).items()}
    wrong = []
    for name, (_, line) in cases(str(tmp_path)).items():
        out, _ = runs[name].communicate(timeout=280)
        if runs[name].returncode == 0 or out != line + "\n":
            wrong.append(f"{name}: exit {runs[name].returncode}, printed {out!r}, expected {line!r}")
    assert not wrong, "\n".join(wrong)
