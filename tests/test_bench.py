"""Every script in bench/ still starts from a fresh clone, so each README figure has a script that runs.

Each script runs as `python bench/<name>.py` in a subprocess whose working directory is an empty
temporary one: the way a user runs it, with bench/ first on sys.path. The cheap ones run a tiny
version of their measurement; the multi-process training benchmarks only parse `--help`
(their imports are what broke before).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")

# script -> (arguments, a string its output must contain). "--help" where a real run costs minutes.
RUNS = {
    "auto_plan.py": (["--help"], "usage:"),            # 216 engine builds and runs: minutes
    "plan_memory.py": (["--help"], "usage:"),          # a fresh process per plan: minutes
    "bf16_state.py": (["--help"], "usage:"),           # four 2-rank training runs
    "build_time.py": (["--layers", "1", "--hidden", "64", "--seq", "32"], "ratio zerogpt / DeepSpeed = "),
    "cpu_adam.py": (["--help"], "usage:"),
    "dedup.py": (["--sources", "60", "--repeats", "1"], "| method |"),
    "disk_offload.py": (["--layers", "1", "--hidden", "64", "--vocab", "256", "--steps", "1", "--file-mb", "8",
                         "--path", "{tmp}"], "step / disk = "),
    "gpu_check.py": (["--help"], "usage:"),          # its tiny CPU dry run is tests/test_gpu_check.py
    "gpu_measure.py": (["--help"], "usage:"),
    "host_gap.py": (["--help"], "usage:"),           # two 2-rank processes loading and training a 44.6M Llama
    "host_step.py": (["--shard-m", "1", "--shards", "1", "--rounds", "1", "--engine-layers", "1"],
                     "(median of the rounds' ratios) |"),
    # native and transformers' Llama under zerogpt, one stage-3 step (no DeepSpeed: its import alone takes seconds)
    "llama_speed.py": (["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "176",
                        "--vocab", "512", "--seq", "16", "--stages", "3", "--steps", "1", "--warmup", "0",
                        "--systems", "native", "hf-zerogpt", "--cache-dir", "{tmp}"],
                       "stage 3: first-step losses agree within 1e-5 (relative): yes"),
    # the streaming way only: each way is a pair of fresh processes, and DeepSpeed's also needs accelerate
    "load_memory.py": (["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
                        "--vocab", "256", "--max-seq", "64", "--ways", "streaming", "--cache-dir", "{tmp}"],
                       "| streaming | 1 |"),
    # one mode, one round of a tiny model: a pair of fresh processes
    "malloc_modes.py": (["--modes", "heap", "--rounds", "1", "--layers", "1", "--heads", "2", "--width", "32",
                         "--vocab", "256", "--seq", "16", "--steps", "4"], "peak RSS MiB"),
    "model_parallel.py": (["--model", "gpt2_tiny", "--seq", "16", "--steps", "1", "--warmup", "0",
                           "--systems", "tp2-sp", "pp2"],
                          "first-step losses agree within 1e-4 (the same step computed 2 ways): yes"),
    "offload.py": (["--help"], "usage:"),
    "pipeline_scale.py": (["--help"], "usage:"),
    "step_memory.py": (["--help"], "usage:"),
    "step_time.py": (["--help"], "usage:"),
    "tokenize_throughput.py": (["--corpus-mb", "0.1", "--vocab-size", "400", "--rounds", "1", "--workers", "1",
                                "--workdir", "{tmp}"], "ours / best baseline"),
}


def test_every_bench_script_is_covered():
    scripts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py")))
    assert scripts == sorted(RUNS), "add each new bench script to RUNS (a tiny run, or --help if it is heavy)"


def test_no_bench_script_shadows_the_standard_library():
    # `python bench/x.py` puts bench/ first on sys.path, where a `tokenize.py` broke every script.
    names = [os.path.basename(p).removesuffix(".py") for p in glob.glob(os.path.join(BENCH, "*.py"))]
    shadowing = [name for name in names if name in sys.stdlib_module_names]
    assert not shadowing, f"rename {shadowing}: they shadow stdlib modules for every script run from bench/"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(RUNS))
def test_bench_script_runs_from_a_fresh_directory(script, tmp_path):
    args, expected = RUNS[script]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script must find the repo itself
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, os.path.join(BENCH, script),
                             *[a.format(tmp=tmp_path / "work") for a in args]],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, f"{script} {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    assert expected in result.stdout, f"{script}: {expected!r} not in its output:\n{result.stdout[-2000:]}"
