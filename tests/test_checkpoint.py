"""Checkpoints (zerogpt/checkpoint.py): exact resume, resharding across world sizes, stages and strategies,
faults (interrupted save, missing/truncated shards, another model's checkpoint).

Every run feeds the same global batch per step (6 sequences, split evenly over 1, 2 or 3 ranks), so a run
at any world size is the same computation up to float summation order.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from zerogpt.context import DistContext

VOCAB, SEQ, GLOBAL_BATCH, LR = 128, 16, 6, 3e-3


def global_batches(steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)


def make_engine(stage: int, *, dropout: float = 0.0, precision: str = "fp32", offload: str = "none",
                strategy=None, seed: int = 0, n_embd: int = 64, disk_path: str | None = None):
    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(seed)
    model = gpt2_tiny(vocab_size=VOCAB, dropout=dropout, max_position_embeddings=SEQ, n_embd=n_embd)
    zero = dict(stage=stage, shard_strategy=strategy or BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(device=offload, path=disk_path))
    cfg = zerogpt.Config(dict(zero=zero, precision=precision))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), config=cfg,
                                ctx=DistContext.current())
    return engine


def train(engine, batches: torch.Tensor, rank: int, world: int) -> list[float]:
    """One optimizer step per global batch; returns the global mean loss of each step."""
    per_rank = GLOBAL_BATCH // world
    losses = []
    for batch in batches:
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        loss = GPTLMLoss(shift=False)(engine(mine[:, :-1]), mine[:, 1:])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


# ------------------------------------------------------------------------------------------------
# exact resume: same world size and stage, dropout on (RNG restored), bit-identical losses

EXACT = [dict(stage=1), dict(stage=2), dict(stage=3), dict(stage=2, precision="bf16"),
         dict(stage=3, precision="fp16"), dict(stage=2, offload="cpu"), dict(stage=3, offload="disk")]


def _exact_resume(rank: int, world: int, root: str) -> list[tuple[list[float], list[float]]]:
    batches = global_batches(6)
    out = []
    for i, setting in enumerate(EXACT):
        kwargs = dict(setting, dropout=0.1)
        if kwargs.get("offload") == "disk":
            kwargs["disk_path"] = root
        torch.manual_seed(100 + rank)  # per-rank dropout streams, as launch_from_torch seeds them
        straight = make_engine(**kwargs)
        losses = train(straight, batches, rank, world)
        straight.close()

        torch.manual_seed(100 + rank)
        first = make_engine(**kwargs)
        head = train(first, batches[:3], rank, world)
        first.save_checkpoint(f"{root}/exact{i}/step_3", extra_state={"step": 3})
        first.close()
        torch.manual_seed(999)  # whatever the new process does before loading must not matter
        resumed = make_engine(**kwargs, seed=7)
        extra = resumed.load_checkpoint(f"{root}/exact{i}/step_3")
        assert extra == {"step": 3}, extra
        tail = train(resumed, batches[3:], rank, world)
        resumed.close()
        out.append((losses, head + tail))
    return out


@pytest.mark.timeout(300)
def test_exact_resume_is_bit_identical(tmp_path):
    results = run_distributed(_exact_resume, 2, str(tmp_path), timeout=280)[0]
    for setting, (straight, resumed) in zip(EXACT, results):
        assert resumed == straight, f"{setting}: {resumed} != {straight}"


# ------------------------------------------------------------------------------------------------
# reshard: save at one (world, stage, strategy), continue at another; within float tolerance

def _strategy(name: str):
    from zerogpt.zero import BucketTensorShardStrategy, TensorShardStrategy

    return TensorShardStrategy() if name == "tensor" else BucketTensorShardStrategy(bucket_mb=0.02)


def _save_runs(rank: int, world: int, root: str, settings: list) -> list[list[float]]:
    """For each (stage, strategy): 3 steps, save, 3 more steps; returns the 6 losses of each."""
    out = []
    for stage, strategy in settings:
        engine = make_engine(stage, strategy=_strategy(strategy))
        losses = train(engine, global_batches(3), rank, world)
        engine.save_checkpoint(f"{root}/w{world}s{stage}{strategy}")
        out.append(losses + train(engine, global_batches(6)[3:], rank, world))
        engine.close()
    return out


def _resume_runs(rank: int, world: int, runs: list) -> list[list[float]]:
    """For each (checkpoint, stage, strategy): load, then the last 3 steps."""
    out = []
    for ckpt, stage, strategy in runs:
        engine = make_engine(stage, strategy=_strategy(strategy), seed=3)
        engine.load_checkpoint(ckpt)
        out.append(train(engine, global_batches(6)[3:], rank, world))
        engine.close()
    return out


RESHARD = [  # (saved world, stage, strategy) -> (resumed world, stage, strategy)
    ((2, 1, "bucket"), (1, 3, "bucket")),
    ((1, 2, "bucket"), (3, 2, "bucket")),
    ((2, 3, "bucket"), (3, 1, "tensor")),
    ((2, 3, "tensor"), (1, 1, "bucket")),
    ((1, 1, "tensor"), (3, 3, "bucket")),
    ((2, 2, "bucket"), (2, 3, "tensor")),
]


@pytest.mark.timeout(400)
def test_reshard_across_world_size_stage_and_strategy(tmp_path):
    """2->1, 1->3, 2->3 ranks; stage 3->1, 1->3; bucket <-> tensor strategy: the continuation matches
    the uninterrupted run within float tolerance (summation order differs across world sizes)."""
    straight = {}
    for world in sorted({saved[0] for saved, _ in RESHARD}):
        settings = sorted({saved[1:] for saved, _ in RESHARD if saved[0] == world})
        for setting, losses in zip(settings, run_distributed(_save_runs, world, str(tmp_path), settings,
                                                             timeout=150)[0]):
            straight[(world, *setting)] = losses
    for world in sorted({resumed[0] for _, resumed in RESHARD}):
        cases = [(saved, resumed) for saved, resumed in RESHARD if resumed[0] == world]
        runs = [("{}/w{}s{}{}".format(tmp_path, *saved), *resumed[1:]) for saved, resumed in cases]
        for (saved, resumed), tail in zip(cases, run_distributed(_resume_runs, world, runs, timeout=150)[0]):
            torch.testing.assert_close(torch.tensor(tail), torch.tensor(straight[saved][3:]), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"saved {saved} -> resumed {resumed}: {m}")


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_checkpoint_without_moments_starts_a_trained_engines_optimizer_fresh(tmp_path, offload):
    """A checkpoint saved before the first step (or the weights alone, as import_megatron writes) holds no moments:
    loaded into an engine that has trained, its optimizer starts fresh, as in a new engine, not from its own."""
    batches = global_batches(5)
    before_any_step = make_engine(2, offload=offload)
    before_any_step.save_checkpoint(tmp_path / "step_0")
    before_any_step.close()
    fresh = make_engine(2, offload=offload, seed=5)
    fresh.load_checkpoint(tmp_path / "step_0")
    expected = train(fresh, batches[:3], 0, 1)
    fresh.close()
    trained = make_engine(2, offload=offload, seed=5)
    train(trained, batches[3:], 0, 1)
    trained.load_checkpoint(tmp_path / "step_0")
    assert train(trained, batches[:3], 0, 1) == expected
    trained.close()


# ------------------------------------------------------------------------------------------------
# reading, consolidation, faults

def test_reader_consolidates_what_state_dict_full_returns(tmp_path):
    from zerogpt.checkpoint import CheckpointReader, resolve_checkpoint

    engine = make_engine(2)
    train(engine, global_batches(2), 0, 1)
    engine.save_checkpoint(tmp_path / "step_2")
    full = engine.state_dict_full()
    reader = CheckpointReader(resolve_checkpoint(str(tmp_path / "step_2")))
    assert reader.meta["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert reader.meta["model"]["class"] == "model_zoo.gpt.GPT"
    assert reader.meta["model"]["config"]["n_embd"] == 64
    assert reader.config_path is not None
    for name in reader.names():
        assert torch.equal(reader.tensor(name), full[name].float()), name
    assert reader.tensor("transformer.h.0.attn.c_attn.weight", kind="exp_avg").abs().sum() > 0


def test_run_directory_resolves_through_latest(tmp_path):
    from zerogpt.checkpoint import CheckpointError, resolve_checkpoint

    engine = make_engine(1)
    engine.save_checkpoint(tmp_path / "checkpoints" / "step_5")
    (tmp_path / "checkpoints" / "latest").write_text("step_5\n")
    assert resolve_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_5")
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "checkpoints"))


def test_missing_and_truncated_shards_are_named(tmp_path):
    from zerogpt.checkpoint import CheckpointError

    engine = make_engine(2)
    engine.save_checkpoint(tmp_path / "ck")
    shards = sorted(f for f in os.listdir(tmp_path / "ck") if f.startswith("r00000_c"))
    victim = tmp_path / "ck" / shards[3]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shards[3]} is truncated or corrupt"):
        engine.load_checkpoint(tmp_path / "ck")
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{shards[3]} is missing"):
        engine.load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        engine.load_checkpoint(tmp_path / "ck")


def _load_without_rank_1_rng(rank: int, world: int, root: str) -> str:
    """Save at 2 ranks, truncate rank 0's RNG file and delete rank 1's, load: every rank's one-line error."""
    from zerogpt.checkpoint import CheckpointError

    engine = make_engine(2)
    train(engine, global_batches(1), rank, world)
    engine.save_checkpoint(f"{root}/ck")
    dist.barrier()
    if rank == 0:
        rng = f"{root}/ck/rng_r00000.safetensors"
        data = open(rng, "rb").read()
        open(rng, "wb").write(data[: len(data) // 2])
        os.unlink(f"{root}/ck/rng_r00001.safetensors")
    dist.barrier()
    try:
        engine.load_checkpoint(f"{root}/ck")
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()
    return "loaded"


@pytest.mark.timeout(120)
def test_missing_or_truncated_rng_file_is_named_on_every_rank(tmp_path):
    """Each rank's RNG file is read before any state is loaded, and a bad one on any rank stops every rank with
    one line naming it (before: a raw FileNotFoundError on that rank while the others waited in a collective)."""
    messages = run_distributed(_load_without_rank_1_rng, 2, str(tmp_path), timeout=100)
    assert messages[0] == messages[1], messages
    assert "rng_r00000.safetensors is unreadable (truncated or corrupt)" in messages[0], messages
    assert len(messages[0].splitlines()) == 1, messages


def test_truncated_or_missing_buffer_file_is_named(tmp_path):
    """A model with a persistent buffer: its buffers.safetensors truncated, then removed, is named in one line
    (before: safetensors' own error without the file, and a bare FileNotFoundError)."""
    import zerogpt
    from zerogpt.checkpoint import CheckpointError

    def engine_with_buffer():
        torch.manual_seed(0)
        model = gpt2_tiny(vocab_size=VOCAB, max_position_embeddings=SEQ, n_embd=32)
        model.register_buffer("counter", torch.arange(4.0))
        return zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                  config=zerogpt.Config(dict(zero=dict(stage=2))), ctx=DistContext.current())

    engine = engine_with_buffer()
    engine.save_checkpoint(tmp_path / "ck")
    buffers = tmp_path / "ck" / "buffers.safetensors"
    buffers.write_bytes(buffers.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="buffers.safetensors is unreadable .truncated or corrupt."):
        engine.load_checkpoint(tmp_path / "ck")
    buffers.unlink()
    with pytest.raises(CheckpointError, match="buffers.safetensors is missing"):
        engine.load_checkpoint(tmp_path / "ck")
    engine.close()


def test_checkpoint_of_another_model_lists_the_mismatched_tensors(tmp_path):
    from zerogpt.checkpoint import CheckpointError

    make_engine(2, n_embd=64).save_checkpoint(tmp_path / "ck")
    other = make_engine(2, n_embd=32)
    with pytest.raises(CheckpointError) as err:
        other.load_checkpoint(tmp_path / "ck")
    message = str(err.value)
    assert "another model" in message
    assert "transformer.wte.weight: model [128, 32] vs checkpoint [128, 64]" in message
    assert "transformer.h.1.mlp.c_fc.weight" in message


def test_checkpoint_holds_no_pickles(tmp_path):
    engine = make_engine(3)
    train(engine, global_batches(1), 0, 1)
    engine.save_checkpoint(tmp_path / "ck", extra_state={"trainer": {"step": 1}})
    files = os.listdir(tmp_path / "ck")
    assert all(f.endswith((".safetensors", ".json", ".py")) for f in files), files
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    assert meta["extra_state"] == {"trainer": {"step": 1}} and meta["global_step"] == 1
    with pytest.raises(TypeError, match="JSON-serialisable"):
        engine.save_checkpoint(tmp_path / "ck2", extra_state={"bad": object()})


# ------------------------------------------------------------------------------------------------
# kill -9 while saving: `latest` stays on the previous checkpoint and resume works

KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, json
    import torch
    sys.path.insert(0, {repo!r})
    import zerogpt.checkpoint as ckpt
    from zerogpt.trainer import Trainer, SaveCheckpointHook, LossHook, latest_checkpoint
    from data_pipeline import DistributedBatchSampler
    from tests.test_checkpoint import make_engine, VOCAB, SEQ
    from model_zoo.gpt import GPTLMLoss

    out, mode = sys.argv[1], sys.argv[2]
    if mode == "kill":  # die half-way through writing step_4's shards, like a SIGKILL from outside
        real, written = ckpt._save_safetensors_atomic, []
        def dying(tensors, path):
            if "step_4" in path and len(written) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            written.append(path) if "step_4" in path else None
            real(tensors, path)
        ckpt._save_safetensors_atomic = dying
    torch.manual_seed(0)
    data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(42)
    engine = make_engine(2, dropout=0.1)
    engine.criterion = GPTLMLoss(shift=False)
    loader = torch.utils.data.DataLoader(data, batch_sampler=DistributedBatchSampler(data, 4, 0, 1, shuffle=True, seed=3))
    losses = []
    class Record(LossHook):
        def logs_at(self, step, max_steps):
            return True
        def after_step(self, trainer):
            losses.append(trainer.state.metrics.loss)
    trainer = Trainer(engine, hooks=[Record(), SaveCheckpointHook(out, save_interval=2, keep_last=5)])
    if mode == "resume":
        trainer.load_state_dict(engine.load_checkpoint(latest_checkpoint(out)))
    trainer.fit(loader, max_steps=6)
    print(json.dumps(losses))
""")


def _run_script(tmp_path, out, mode) -> subprocess.CompletedProcess:
    script = tmp_path / "kill_run.py"
    script.write_text(KILL_SCRIPT.format(repo=os.getcwd()))
    return subprocess.run([sys.executable, str(script), str(out), mode], capture_output=True, text=True,
                          timeout=150, cwd=os.getcwd())


@pytest.mark.timeout(400)
def test_kill_during_save_keeps_latest_and_resume_works(tmp_path):
    straight = _run_script(tmp_path, tmp_path / "straight", "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    straight_losses = json.loads(straight.stdout.strip().splitlines()[-1])

    killed = _run_script(tmp_path, tmp_path / "run", "kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_2"
    assert not (root / "step_4").exists()
    assert (root / ".step_4.tmp").is_dir() and not (root / ".step_4.tmp" / "meta.json").exists()

    resumed = _run_script(tmp_path, tmp_path / "run", "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1]) == straight_losses[2:]
    assert (root / "latest").read_text().strip() == "step_6"
    assert not (root / ".step_4.tmp").exists()  # the partial save was cleaned up when step_4 was re-saved


def test_a_resave_killed_between_its_renames_resumes_from_the_set_aside_checkpoint(tmp_path):
    """Re-saving step N moves the old step_N aside (.step_N.old) before the new one takes its place; a kill between
    the two renames leaves `latest` naming a directory that is gone. The next resume puts the old one back."""
    from zerogpt.checkpoint import resolve_checkpoint
    from zerogpt.trainer.hooks.checkpoint import latest_checkpoint

    engine = make_engine(1)
    train(engine, global_batches(1), 0, 1)
    root = tmp_path / "checkpoints"
    engine.save_checkpoint(root / "step_1")
    (root / "latest").write_text("step_1\n")
    os.replace(root / "step_1", root / ".step_1.old")  # the re-save's first rename, then the kill
    assert resolve_checkpoint(str(tmp_path)) == str(root / "step_1")
    os.replace(root / "step_1", root / ".step_1.old")
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_1")
    assert sorted(os.listdir(root)) == ["latest", "step_1"]
    fresh = make_engine(1, seed=3)
    fresh.load_checkpoint(str(root / "step_1"))
    for name, value in engine.state_dict_full().items():
        assert torch.equal(fresh.state_dict_full()[name], value), name
    engine.close()
    fresh.close()
