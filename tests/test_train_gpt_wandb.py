"""train_gpt.py with `train.wandb` in offline mode (no network): the run's W&B history holds the numbers of
metrics.jsonl at the same steps and its config the resolved config; the checkpoint carries the W&B run id, so
`--resume auto` logs into the same W&B run; without wandb installed the run stops before launch, in one line."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.test_train_gpt import DEMO, ROOT, SHORT, overrides, read_jsonl, user_error
from tests.trainer.wandb_records import offline_runs, scalars

pytest.importorskip("wandb")


def one_process(args, env, timeout=150):
    """train_gpt.py as one process, with wandb's own files (settings, cache) under the test's folder."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_offline_run_holds_the_metrics_and_resume_continues_it(tmp_path):
    out, data = tmp_path / "run", tmp_path / "data"
    env = {var: str(tmp_path / "wandb-home") for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    args = ["--config", DEMO, *overrides(SHORT + [f"train.output_dir={out}", f"data.path={data}/stdlib_docs",
                                                  f"data.tokenizer={data}/tokenizer", "train.wandb.mode=offline",
                                                  "train.wandb.project=zerogpt-ci", "train.wandb.tags=['demo']"])]
    proc = one_process(args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (run,) = offline_runs(str(out))
    assert (run["project"], run["name"]) == ("zerogpt-ci", "run")
    assert run["config"]["train"]["max_steps"] == 6 and run["config"]["zero"]["stage"] == 2  # the resolved config
    assert run["config"]["train"]["wandb"] == {"mode": "offline", "project": "zerogpt-ci", "tags": ["demo"]}
    metrics = read_jsonl(out / "metrics.jsonl")
    for split, key in (("train", "train/loss"), ("train", "train/grad_norm"), ("valid", "valid/loss")):
        logged = {r["step"]: r[key.split("/")[1]] for r in metrics if r["split"] == split}
        assert scalars(run, key) == logged, key  # the same steps and numbers as metrics.jsonl
    assert sorted(scalars(run, "train/loss")) == [2, 4, 6] and sorted(scalars(run, "valid/loss")) == [0, 3, 6]
    assert scalars(run, "train/skipped_steps") == {2: 0, 4: 0, 6: 0} and scalars(run, "mem/host_rss_mb")
    with open(out / "checkpoints" / "step_6" / "meta.json") as f:
        assert json.load(f)["extra_state"]["hooks"]["WandbHook"] == {"run_id": run["id"]}

    proc = one_process(args + ["--resume", "auto", "--set", "train.max_steps=8"], env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    first, second = offline_runs(str(out))
    assert first["id"] == second["id"] == run["id"]  # the same W&B run, continued
    assert sorted(scalars(second, "train/loss")) == [8] and sorted(scalars(second, "valid/loss")) == [8]
    assert second["config"]["train"]["max_steps"] == 8


def test_missing_wandb_stops_before_launch_in_one_line(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    code, err = user_error(capsys, "--set", "train.wandb.project=x", "--set", "train.output_dir=/nonexistent/x")
    assert code == 1 and err == ("error: train.wandb is set but wandb is not installed: pip install 'zerogpt[wandb]' "
                                 "(or remove train.wandb, or set train.wandb.mode='disabled')\n")
    assert not os.path.exists("/nonexistent/x")
