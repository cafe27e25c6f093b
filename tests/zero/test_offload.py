"""Offload (zero/offload.py and the offload paths of sharded_optim.py): optimizer state on the host or
on disk, stage-3 param shards on the host.

Parity: every offload mode reproduces the same engine run without offload (same stage, world size,
precision, accumulation), with torch AdamW, CPUAdam and HybridAdam, on 1 and 2 gloo ranks. Placement:
on this CPU-only machine "device" and "host" are both CPU memory, so each run checks the home the
engine records (`memory_stats()`), the tensors' storage (disk state really lives in memory-mapped
files under the path) and that the files are gone after close / collection / process exit.
Then bad input: param offload below stage 3, disk path problems, a CPU Adam build failure.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.gpu_plan import planned
from zerogpt.context import DistContext

STEPS = 4
MICRO_BATCH = 2
SEQ = 16
VOCAB = 128
LR = 3e-3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Setting:
    """One engine run; `baseline()` is the same run without any offload, with torch AdamW."""

    stage: int
    offload: str = "none"  # optimizer (master + state): none | cpu | disk
    param: bool = False  # stage-3 param shards rest on the host
    optimizer: str = "adamw"  # adamw | cpu_adam | hybrid_adam | sgd
    precision: str = "fp32"
    accum: int = 2
    seed_form: bool = False  # Colossal-AI form: model_config.offload_config / optimizer_config.cpu_offload
    eager: bool = False  # hand each chunk's reduced grads over right after launch (CUDA's plan), taken on CPU

    def baseline(self) -> "Setting":
        return Setting(self.stage, precision=self.precision, accum=self.accum)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    from zerogpt.optim import CPUAdam, HybridAdam

    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    cls = {"adamw": torch.optim.AdamW, "cpu_adam": CPUAdam, "hybrid_adam": HybridAdam}[name]
    return cls(model.parameters(), lr=LR, weight_decay=0.1)


def make_config(s: Setting, disk_path: str | None):
    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    zero = dict(shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02))
    if s.seed_form:
        assert s.stage == 3 and s.offload == "cpu" and s.param, s  # the seed form is ZeRO-3 (no stage key)
        zero.update(model_config=dict(offload_config=dict(device="cpu")), optimizer_config=dict(cpu_offload=True))
    else:
        zero.update(stage=s.stage, offload_optimizer=dict(device=s.offload, path=disk_path))
        if s.param:
            zero["offload_param"] = dict(device="cpu")
    return zerogpt.Config(dict(zero=zero, precision=s.precision, GRADIENT_ACCUMULATION=s.accum))


def build_engine(s: Setting, disk_path: str | None = None):
    import zerogpt

    model = tiny_model()
    with planned(hand_over_at_launch=s.eager):
        return zerogpt.initialize(model, make_optimizer(s.optimizer, model), config=make_config(s, disk_path),
                                  ctx=DistContext.current())


def batches(world: int, accum: int) -> torch.Tensor:
    """(steps, accum, world, B, T+1) token ids: the same global batches for every run."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (STEPS, accum, world, MICRO_BATCH, SEQ + 1), generator=g)


def placement_facts(engine) -> dict:
    """What lives where, from the engine's records and the tensors themselves (plain data)."""
    optim, placement = engine.sharded_optim, engine.placement
    state = [t for entry in optim.states.values() for t in entry.tensors()]
    disk_dir = placement.disk_dir
    return dict(
        stats=engine.memory_stats(),
        state_disk_backed=[placement.is_disk_backed(t) for t in state],
        state_devices={t.device.type for t in state},
        num_state_tensors=len(state),
        disk_dir=disk_dir,
        disk_files=sorted(os.listdir(disk_dir)) if disk_dir else [],
        param_shard_homes={c.shard_home for c in engine.chunks},
        gathered_at_rest=sum(c.full is not None for c in engine.chunks),
    )


def train(rank: int, world: int, s: Setting, disk_path: str | None) -> dict:
    """Train STEPS steps; return losses, consolidated params and placement facts."""
    engine = build_engine(s, disk_path)
    loss_fn = GPTLMLoss(shift=False)
    losses, before_step = [], None
    for step in batches(world, s.accum):
        step_loss = torch.zeros(())
        for j in range(s.accum):
            m = step[j, rank]
            loss = loss_fn(engine(m[:, :-1]), m[:, 1:])
            engine.backward(loss)
            if j == s.accum - 1:
                before_step = engine.memory_stats()  # the reduced grad shards exist only now
            engine.step()
            engine.zero_grad()
            step_loss += loss.detach().float() / s.accum
        if dist.is_initialized():
            dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    facts = placement_facts(engine)
    facts["grads_before_step"] = before_step["grads"]
    params = engine.state_dict_full()
    engine.close()
    facts["disk_dir_after_close"] = bool(facts["disk_dir"]) and os.path.exists(facts["disk_dir"])
    return dict(losses=losses, params=params, facts=facts)


def _train_all(rank: int, world: int, settings: list[Setting], disk_path: str) -> dict:
    return {s: train(rank, world, s, disk_path) for s in settings}


# -- checks ------------------------------------------------------------------------------------------


def assert_same_run(run: dict, base: dict, rtol: float, what: str) -> None:
    """Losses elementwise and parameters as a whole-model relative L2 error (see test_parity.py for why
    not per tensor: the key bias has a zero true gradient, and Adam amplifies its rounding noise)."""
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(base["losses"]), rtol=rtol, atol=rtol,
                               msg=lambda m: f"{what}: losses differ from the run without offload: {m}")
    names = [n for n in base["params"] if n != "lm_head.weight"]  # tied to wte
    diff = torch.cat([(run["params"][n] - base["params"][n]).reshape(-1) for n in names])
    ref = torch.cat([base["params"][n].reshape(-1) for n in names])
    err = (diff.norm() / ref.norm()).item()
    assert err <= rtol, f"{what}: relative parameter error {err:.2e} > {rtol:.0e}"


def assert_placement(s: Setting, facts: dict, rank: int) -> None:
    """Nothing meant to be off the device is on it; disk state is memory-mapped files, removed on close."""
    what = f"{s} rank {rank}"
    stats, grads = facts["stats"], facts["grads_before_step"]
    optim_home = {"none": "device", "cpu": "host", "disk": "disk"}[s.offload]
    for category in ("master", "optimizer"):
        if s.offload == "none":
            continue
        if category == "master" and s.precision == "fp32" and s.param and s.offload == "cpu":
            # the host param shard is the fp32 master (issue 30: no second copy), counted once, as params
            assert sum(stats["master"].values()) == 0 and stats["params"]["host"] > 0, f"{what}: {stats}"
            continue
        assert stats[category][optim_home] > 0, f"{what}: no {category} bytes at {optim_home}: {stats}"
        others = [h for h in ("device", "host", "disk") if h != optim_home]
        assert all(stats[category][h] == 0 for h in others), f"{what}: {category} not only at {optim_home}: {stats}"
    if s.offload != "none":  # reduced fp32 grad shards land on the host, next to the CPU step
        assert grads["host"] > 0 and grads["device"] == 0 and grads["disk"] == 0, f"{what}: grads {grads}"
        assert facts["state_devices"] == {"cpu"}, f"{what}: optimizer state on {facts['state_devices']}"
    if s.offload == "disk":
        assert all(facts["state_disk_backed"]), f"{what}: state tensors not memory-mapped: {facts['state_disk_backed']}"
        # one file per master / exp_avg / exp_avg_sq of each trainable chunk, there during training
        assert len(facts["disk_files"]) == facts["num_state_tensors"] > 0, facts["disk_files"]
        assert facts["disk_dir"] is not None and not facts["disk_dir_after_close"], f"{what}: files left after close"
    else:
        assert not any(facts["state_disk_backed"]) and facts["disk_dir"] is None, what
    if s.param:
        assert stats["params"]["host"] > 0 and stats["params"]["device"] == 0, f"{what}: params {stats['params']}"
        assert facts["param_shard_homes"] == {"host"} and facts["gathered_at_rest"] == 0, what
    else:
        assert stats["params"]["host"] == 0 and stats["params"]["device"] > 0, f"{what}: params {stats['params']}"
    if s.offload == "none" and not s.param:
        assert all(stats[c]["host"] == stats[c]["disk"] == 0 for c in stats), f"{what}: {stats}"


PARITY = [
    # every stage x {cpu, disk}, with accumulation, torch AdamW
    *[Setting(stage, offload) for stage in range(4) for offload in ("cpu", "disk")],
    # stage-3 param offload, with and without optimizer offload; the seed config form
    Setting(3, "cpu", param=True), Setting(3, "none", param=True), Setting(3, "disk", param=True),
    Setting(3, "cpu", param=True, seed_form=True),
    # no accumulation
    Setting(1, "cpu", accum=1), Setting(3, "disk", accum=1),
    # the fused CPU optimizers
    Setting(1, "cpu", optimizer="cpu_adam"), Setting(2, "disk", optimizer="cpu_adam"),
    Setting(3, "cpu", param=True, optimizer="hybrid_adam"), Setting(0, "cpu", optimizer="hybrid_adam", accum=1),
    # bf16 (fp32 masters on the host, bf16 params on the device)
    Setting(0, "disk", precision="bf16"), Setting(2, "cpu", precision="bf16"),
    Setting(3, "cpu", param=True, precision="bf16"),
    # the hand-over CUDA uses for offloaded grads (each chunk as soon as its reduction is launched)
    Setting(2, "cpu", eager=True), Setting(3, "cpu", param=True, precision="bf16", eager=True),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2])
def test_offload_parity_and_placement(world, tmp_path):
    settings = PARITY + sorted({s.baseline() for s in PARITY}, key=str)
    results = run_distributed(_train_all, world, settings, str(tmp_path), timeout=580)
    for s in {s.baseline() for s in PARITY}:
        for rank in range(world):
            assert_placement(s, results[rank][s]["facts"], rank)
    for s in PARITY:
        base = results[0][s.baseline()]
        # Offload moves the same fp32 arithmetic (in bf16 too: fp32 masters and grad shards) to the
        # host, so torch AdamW runs match bit for bit; DeepSpeed's fused op differs by rounding only.
        assert_same_run(results[0][s], base, 1e-5, f"{s} world {world}")
        for rank in range(world):
            assert_placement(s, results[rank][s]["facts"], rank)
            if world > 1:  # every rank computed the same losses and consolidated parameters
                assert results[rank][s]["losses"] == results[0][s]["losses"]
    assert os.listdir(tmp_path) == [], "disk offload left files behind"


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_amsgrad_state_is_preallocated_too(offload, tmp_path):
    """torch reads max_exp_avg_sq from state it finds pre-filled (it would raise KeyError otherwise)."""
    import zerogpt

    losses = {}
    for device in ("none", offload):
        model = tiny_model()
        cfg = zerogpt.Config(dict(zero=dict(stage=2, offload_optimizer=dict(device=device, path=str(tmp_path)))))
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, amsgrad=True), config=cfg,
                                    ctx=DistContext.current())
        losses[device] = []
        for x in batches(1, 1)[:, 0, 0]:
            loss = GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses[device].append(loss.item())
        stats = engine.memory_stats()
        engine.close()
    assert losses[offload] == losses["none"]
    home = "host" if offload == "cpu" else "disk"
    assert stats["optimizer"][home] == 3 * stats["master"][home] and stats["optimizer"]["device"] == 0, stats


def _sgd_stats(rank: int, world: int) -> dict:
    return train(rank, world, Setting(2, "cpu", optimizer="sgd", accum=1), None)["facts"]["stats"]


@pytest.mark.timeout(120)
def test_non_adam_state_is_accounted_on_the_host():
    """SGD's momentum is created lazily by torch; the engine still records it where it lives."""
    stats = run_distributed(_sgd_stats, 1, timeout=100)[0]
    assert stats["optimizer"]["host"] > 0 and stats["optimizer"]["device"] == 0, stats


def test_param_offload_gathers_chunk_by_chunk_with_prefetch():
    """Stage-3 param offload: shards stay in host memory; each forward gathers onto the device only
    the chunks in use plus the next `prefetch` in the recorded order, and releases them after use."""
    import zerogpt
    from zerogpt.zero import TensorShardStrategy

    model = tiny_model()
    zero = dict(stage=3, shard_strategy=TensorShardStrategy(), prefetch=2, offload_param=dict(device="cpu"),
                offload_optimizer=dict(device="cpu"))
    engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                config=zerogpt.Config(dict(zero=zero)), ctx=DistContext.current())
    log, held = [], []
    for chunk in engine.chunks:  # log every gather: (chunk, prefetch?, needed a copy from the host?)
        def gather(async_op: bool = False, chunk=chunk, original=chunk.gather) -> None:
            cold = chunk.full_buffer is None
            original(async_op)
            if not engine.gather_hooks.in_backward:
                log.append((chunk.plan.index, async_op, cold))
                held.append(sum(c.full_buffer is not None for c in engine.chunks))
        chunk.gather = gather
    shard_ptrs = [c.shard.data_ptr() for c in engine.chunks]
    for step, x in enumerate(batches(1, 1)[:, 0, 0]):
        log.clear(), held.clear()
        engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
        engine.zero_grad()
        assert all(c.full_buffer is None for c in engine.chunks), f"step {step}: chunks left gathered"
        assert {c.shard_home for c in engine.chunks} == {"host"}
        assert [c.shard.data_ptr() for c in engine.chunks] == shard_ptrs  # updated in place, never moved
        if step == 0:
            continue  # the first pass records the order
        order = list(dict.fromkeys(engine.gather_hooks.recorded_order))
        on_demand = [c for c, async_op, cold in log if cold and not async_op]
        prefetched = [c for c, async_op, cold in log if cold and async_op]
        assert on_demand == order[:1] and prefetched == order[1:], f"step {step}: {log}"
        # a module's own chunks (weight + bias) + 2 prefetched + the tied embedding/head, of 28
        assert max(held) <= 2 + 2 + 1 < len(engine.chunks) // 4, (max(held), len(engine.chunks))
    engine.close()


# -- disk files: removed on close, on collection, at process exit; engines don't collide ------------


def test_disk_state_streams_chunk_by_chunk_through_the_files(tmp_path):
    """Disk offload steps one chunk at a time: read-ahead of the next chunk's files, the step, the
    write-back into the param shard, then eviction; the state lives in the files themselves."""
    import numpy as np

    engine = build_engine(Setting(2, "disk", accum=1), str(tmp_path))
    optim, placement = engine.sharded_optim, engine.placement
    owner = {t.data_ptr(): index for index, entry in optim.states.items() for t in entry.tensors()}
    events, written = [], []
    for name in ("prefetch", "evict"):
        def log(tensor, name=name, original=getattr(placement, name)):
            index = owner[tensor.data_ptr()]
            events.append((name, index))
            if name == "evict":  # the updated master must already be in its param shard
                written.append(torch.equal(engine.chunks[index].shard, optim.states[index].master))
            original(tensor)
        setattr(placement, name, log)
    for entry in optim.states.values():  # each chunk steps alone: only its master has a grad then
        def logged_step(*a, original=entry.optimizer.step, **k):
            events.append(("step", [i for i, s in optim.states.items() if s.master.grad is not None]))
            return original(*a, **k)
        entry.optimizer.step = logged_step
    x = batches(1, 1)[0, 0, 0]
    engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
    engine.step()
    order = list(optim.states)
    expected = []
    for i, index in enumerate(order):
        expected += [("prefetch", order[i + 1])] * 3 if i + 1 < len(order) else []  # master, exp_avg, exp_avg_sq
        expected += [("step", [index])] + [("evict", index)] * 3
    assert events == expected
    assert written and all(written), written
    files = [np.fromfile(os.path.join(placement.disk_dir, f), dtype=np.float32)
             for f in sorted(os.listdir(placement.disk_dir))]
    for index, entry in optim.states.items():
        for name, t in {"master": entry.master, **entry.state_tensors()}.items():
            assert t.abs().sum() > 0, (index, name)  # really updated, not zero files
            assert any(f.shape == t.shape and np.array_equal(f, t.numpy()) for f in files), (index, name)
    engine.close()


def test_disk_files_removed_when_engine_is_collected(tmp_path):
    engine = build_engine(Setting(2, "disk", accum=1), str(tmp_path))
    disk_dir = engine.placement.disk_dir
    assert disk_dir.startswith(str(tmp_path)) and len(os.listdir(disk_dir)) > 0
    del engine
    gc.collect()  # the engine sits in reference cycles (module hooks <-> hooks object)
    assert not os.path.exists(disk_dir) and os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_disk_files_removed_when_process_ends_without_close(tmp_path, ending):
    """A script that never calls engine.close() and keeps the engine alive in a global until it exits,
    normally or by an uncaught exception."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from tests.zero.test_offload import Setting, build_engine, train
        engine = build_engine(Setting(1, "disk", accum=1), {str(tmp_path)!r})
        print("DISK", engine.placement.disk_dir, len(os.listdir(engine.placement.disk_dir)), flush=True)
        if {ending == "raises"}:
            raise RuntimeError("training crashed")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert res.returncode == (1 if ending == "raises" else 0), res.stderr
    _, disk_dir, num_files = next(line for line in res.stdout.splitlines() if line.startswith("DISK")).split()
    assert int(num_files) > 0 and disk_dir.startswith(str(tmp_path))
    assert not os.path.exists(disk_dir) and os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
def test_disk_files_removed_when_a_forked_worker_ends_without_close(tmp_path):
    """A fork-started multiprocessing worker ends in os._exit, which skips atexit handlers."""
    script = textwrap.dedent(f"""
        import multiprocessing as mp, os, sys
        sys.path.insert(0, {REPO!r})
        from tests.zero.test_offload import Setting, build_engine

        def worker(queue):
            global engine
            engine = build_engine(Setting(1, "disk", accum=1), {str(tmp_path)!r})
            queue.put((engine.placement.disk_dir, len(os.listdir(engine.placement.disk_dir))))

        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=worker, args=(queue,))
        proc.start()
        print("DISK", *queue.get(timeout=100), flush=True)
        proc.join(timeout=100)
        sys.exit(proc.exitcode)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    _, disk_dir, num_files = next(line for line in res.stdout.splitlines() if line.startswith("DISK")).split()
    assert int(num_files) > 0 and disk_dir.startswith(str(tmp_path))
    assert not os.path.exists(disk_dir) and os.listdir(tmp_path) == []


def test_two_disk_engines_in_one_process_do_not_collide(tmp_path):
    """Same path, same rank, same pid: each engine gets its own files, and closing one spares the other."""
    first = build_engine(Setting(2, "disk", accum=1), str(tmp_path))
    second = build_engine(Setting(2, "disk", accum=1), str(tmp_path))
    assert first.placement.disk_dir != second.placement.disk_dir
    x = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    for engine in (first, second):
        engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
        engine.step()
    first.close()
    assert not os.path.exists(first.placement.disk_dir or "") and len(os.listdir(tmp_path)) == 1
    loss = GPTLMLoss(shift=False)(second(x[:, :-1]), x[:, 1:])
    second.backward(loss)
    second.step()  # its memory-mapped state is intact
    assert torch.isfinite(loss)
    second.close()
    assert os.listdir(tmp_path) == []


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [
    dict(stage=2, offload_param=dict(device="cpu")),
    dict(stage=1, model_config=dict(offload_config=dict(device="cpu"))),  # seed form, explicit stage
])
def test_param_offload_below_stage_3_is_refused(zero):
    import zerogpt

    model = tiny_model()
    with pytest.raises(ValueError, match=r"offload_param needs zero.stage=3, got \d; pass --set zero.stage=3"):
        zerogpt.initialize(model, torch.optim.AdamW(model.parameters()), config=zerogpt.Config(dict(zero=zero)),
                           ctx=DistContext.current())


def _initialize_disk(path: str | None) -> None:
    build_engine(Setting(2, "disk", accum=1), path).close()


def test_disk_path_missing_or_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="needs a directory for the state files.*zero.offload_optimizer.path"):
        _initialize_disk(None)
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=re.escape(f"'{missing}' does not exist; create it (mkdir -p {missing})")):
        _initialize_disk(str(missing))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        _initialize_disk(str(a_file))


def _check_as_nobody(path: str) -> str:
    """Run the engine's disk-path check as the unprivileged user 'nobody' (forked child); its message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(65534)
            from zerogpt.zero.offload import check_disk_path

            check_disk_path(path, 1)
            msg = "no error"
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        os.write(write, msg.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    msg = os.read(read, 4096).decode()
    os.close(read)
    return msg


def test_disk_path_not_writable(tmp_path):
    """A real refusal: a read-only directory, tried as an unprivileged user (root ignores mode bits,
    which is also why the engine creates a file instead of asking os.access)."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(ValueError, match="is not writable by this user.*zero.offload_optimizer.path"):
            _initialize_disk(str(ro))
        return
    parent = tempfile.mkdtemp(dir="/tmp")  # pytest's tmp_path sits under a root-only 0700 directory
    try:
        os.chmod(parent, 0o755)
        ro = os.path.join(parent, "ro")
        os.mkdir(ro, 0o555)
        msg = _check_as_nobody(ro)
        assert msg.startswith("ValueError") and "is not writable by this user (Permission denied)" in msg, msg
        assert "zero.offload_optimizer.path" in msg, msg
        hidden = str(tmp_path / "x")
        os.mkdir(hidden)  # exists, but 'nobody' may not enter pytest's root-only parent
        msg = _check_as_nobody(hidden)
        assert "cannot be reached by this user (Permission denied)" in msg and "does not exist" not in msg, msg
    finally:
        shutil.rmtree(parent)


def test_disk_path_too_small(tmp_path, monkeypatch):
    """Simulated: report 1 KiB free (a real small filesystem would need a mount)."""
    import zerogpt.zero.offload as offload

    real = offload.shutil.disk_usage
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    with pytest.raises(ValueError, match=r"has 0.00 GiB free but the optimizer state of this rank needs "
                                         r"[0-9.]+ GiB; free space there.*device='cpu'"):
        _initialize_disk(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_disk_space_is_checked_for_every_rank_of_the_node(tmp_path, monkeypatch):
    """Room for one rank's state but not for the two ranks torchrun started on this node."""
    import zerogpt.zero.offload as offload
    from zerogpt.zero.offload import check_disk_path

    real = offload.shutil.disk_usage
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: real(p)._replace(free=3 * 2**20))
    check_disk_path(str(tmp_path), 2 * 2**20, local_ranks=1)
    with pytest.raises(ValueError, match=r"the 2 ranks on this node needs 0.00 GiB"):
        check_disk_path(str(tmp_path), 2 * 2**20, local_ranks=2)
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"the 2 ranks on this node"):
        _initialize_disk(str(tmp_path))


def test_disk_offload_needs_an_adam_optimizer(tmp_path):
    with pytest.raises(ValueError, match="SGD is not an Adam-family optimizer.*device='cpu'"):
        build_engine(Setting(2, "disk", optimizer="sgd", accum=1), str(tmp_path))


def _fallback_run(rank: int, world: int, simulate_failure: bool) -> dict:
    from zerogpt.optim import cpu_adam

    if simulate_failure:  # as if the op's JIT build had failed in this process
        cpu_adam._ds_op_cache = (None, "RuntimeError: simulated build failure")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = train(rank, world, Setting(3, "cpu", param=True, optimizer="hybrid_adam", accum=1), None)
        run2 = build_engine(Setting(1, "cpu", optimizer="cpu_adam", accum=1))  # a second optimizer: no new warning
        backends = {run2.optimizer.backend}
        run2.close()
    run["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                       and "CPU Adam" in str(w.message)]
    run["backends"] = backends
    return run


@pytest.mark.timeout(600)  # a cold DeepSpeed op build can take minutes on a loaded 2-core VM
def test_cpu_adam_build_failure_falls_back_and_trains_the_same():
    failed = run_distributed(_fallback_run, 1, True, timeout=580)[0]
    assert failed["backends"] == {"torch-fused"}
    assert len(failed["warnings"]) == 1 and "simulated build failure" in failed["warnings"][0], failed["warnings"]
    assert "falling back to torch's fused Adam" in failed["warnings"][0]
    normal = run_distributed(_fallback_run, 1, False, timeout=580)[0]
    assert_same_run(failed, normal, 1e-5, "torch fallback vs default backend")


# -- on a GPU: offloaded state really is in (pinned) host memory --------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_offload_on_cuda_keeps_state_in_pinned_host_memory(tmp_path):
    import zerogpt

    results = {}
    for s in (Setting(2), Setting(2, "cpu"), Setting(3, "cpu", param=True), Setting(2, "disk")):
        model = tiny_model().cuda()
        engine = zerogpt.initialize(model, make_optimizer("adamw", model), config=make_config(s, str(tmp_path)),
                                    ctx=DistContext.current())
        x = batches(1, 1)[:, 0, 0].cuda()
        losses = []
        for step in x:
            loss = GPTLMLoss(shift=False)(engine(step[:, :-1]), step[:, 1:])
            engine.backward(loss)
            if s.offload != "none":
                assert engine.grad_path.hand_over_at_launch  # copies start while backward runs
                assert all(s.grad.device.type == "cpu" for s in engine.sharded_optim.states.values()
                           if s.grad is not None)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        results[s] = losses
        for index, entry in engine.sharded_optim.states.items():
            for name, t in {"master": entry.master, **entry.state_tensors()}.items():
                assert t.device.type == ("cuda" if s.offload == "none" else "cpu"), (s, name)
                if s.offload == "cpu":
                    assert t.is_pinned(), (s, name)
        if s.param:
            assert all(c.shard.device.type == "cpu" and c.shard.is_pinned() for c in engine.chunks)
        engine.close()
    base = results[Setting(2)]
    for s, losses in results.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(base), rtol=1e-5, atol=1e-5)
