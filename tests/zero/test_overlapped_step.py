"""The host step behind the next forward (issue 29 point 3): with the masters on the host, each chunk's optimizer
step runs on a worker thread and the next forward's first use of a chunk waits for that chunk alone (stage 3: its
gather; stages 1-2: the pre-forward hook of a block or module that owns it, which also all-gathers it).

The build plans it where the compute is a GPU (EnginePlan.host_step_overlaps); here that plan is taken on CPU
(tests/zero/gpu_plan.py), where the same code runs (the worker only computes on the host). It must be the plain
step bit for bit: norm, clip factor and non-finite flag are computed before the chunks are queued.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model_zoo.gpt import GPTLMLoss, gpt2_tiny
from tests.dist_utils import run_distributed
from tests.zero.gpu_plan import planned
from zerogpt.context import DistContext

VOCAB, SEQ, MICRO, STEPS, ACCUM = 96, 16, 2, 4, 2
SETTINGS = [dict(precision="bf16", clip=1.0), dict(precision="bf16", clip=None),
            dict(precision="fp32", clip=0.05), dict(precision="bf16", clip=1.0, state_dtype="bf16"),
            dict(precision="bf16", clip=1.0, stage=2), dict(precision="fp32", clip=None, stage=2),
            dict(precision="bf16", clip=0.05, stage=1),
            # the shipped single-GPU config's layout: stage 3 with the params on the device, the optimizer offloaded
            dict(precision="bf16", clip=1.0, offload_param=False),
            # a GPU run's pinned staging of the compute copy, sent from the worker (planned here for the overlapped
            # run alone: the plain run, unstaged, is what it must equal)
            dict(precision="bf16", clip=1.0, offload_param=False, staged=True),
            dict(precision="bf16", clip=0.05, stage=2, staged=True),
            # stage 0 waits in the modules' pre-forward hooks as stages 1-2 do; a disk master's pages are read ahead
            # and let go by the worker
            dict(precision="bf16", clip=1.0, stage=0), dict(precision="bf16", clip=1.0, disk=True),
            dict(precision="fp32", clip=0.05, stage=1, disk=True)]
# The step taken as each gradient leaves for the host (zero/host_step.py's speculation), beside: it must be the plain
# step too, where it stands (no clip: clip=None or one above every norm) and where the clip makes it step again.
# A chunk steps ahead where its gradient crosses to the host once per step, whole: not where the micro-steps' sums
# are added on the host (param offload with accumulation, the last setting), which steps at engine.step() as before.
SPECULATED = [dict(precision="bf16", clip=None, offload_param=False),
              dict(precision="bf16", clip=1.0, offload_param=False),
              dict(precision="bf16", clip=100.0, offload_param=False, staged=True),
              dict(precision="fp32", clip=0.05, stage=2), dict(precision="bf16", clip=None, stage=0),
              dict(precision="bf16", clip=100.0, state_dtype="bf16", stage=1), dict(precision="bf16", clip=None)]


def make_engine(precision: str, clip: float | None, state_dtype: str = "fp32", stage: int = 3,
                offload_param: bool = True, staged: bool = False, disk: bool = False, *, overlap: bool,
                device: str = "cpu", speculate: bool = False):
    """Stage 3 offloads parameters (unless not `offload_param`) and optimizer; stages 0-2 the optimizer alone.
    `disk`: the optimizer state in memory-mapped files (a fresh directory per engine)."""
    import tempfile

    import zerogpt
    from zerogpt.zero import BucketTensorShardStrategy

    torch.manual_seed(0)
    model = gpt2_tiny(vocab_size=VOCAB, dropout=0.0, max_position_embeddings=SEQ)
    home = dict(device="disk", path=tempfile.mkdtemp(prefix="zerogpt-test-disk-")) if disk else dict(device="cpu")
    zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.02),
                offload_optimizer=dict(**home, state_dtype=state_dtype))
    if stage == 3 and offload_param:
        zero["offload_param"] = dict(device="cpu")
    cfg = zerogpt.Config(dict(zero=zero, precision=precision, clip_grad_norm=clip, GRADIENT_ACCUMULATION=ACCUM))
    ctx = DistContext.current(torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu")
    # what a GPU run plans (the step behind the next forward, staged compute copies), taken on CPU; the plain run's
    # plan keeps the step in place
    staging = dict(stages_compute_copies=True) if staged and overlap else {}
    with planned(host_step_overlaps=overlap, host_step_speculates=speculate, hand_over_at_launch=speculate,
                 **staging):
        return zerogpt.initialize(model, dict(type="HybridAdam", lr=3e-3, weight_decay=0.1), config=cfg, ctx=ctx)


def batches(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS, ACCUM, world, MICRO, SEQ + 1), generator=g)


def train(engine, rank: int, world: int, device: str = "cpu") -> tuple[list[float], list[bool], list[float]]:
    """Losses, whether every chunk still had its step pending right after each engine.step(), and the host step
    seconds the engine reported then."""
    losses, deferred, host_s = [], [], []
    for step in batches(world):
        for micro in step:
            tokens = micro[rank].to(device)
            loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            if engine.step() is not None:
                deferred.append(all(c.pending_step is not None for c in engine.chunks if c.plan.trainable))
                host_s.append(engine.last_host_step_s)
            engine.zero_grad()
            total = loss.detach().float().clone()
            if world > 1:
                dist.all_reduce(total)
            losses.append(total.item() / world)
    return losses, deferred, host_s


def _compare(rank: int, world: int, device: str = "cpu") -> list[dict]:
    out = []
    for setting in SETTINGS:
        run = {}
        for overlap in (False, True):
            engine = make_engine(**setting, overlap=overlap, device=device)
            losses, deferred, host_s = train(engine, rank, world, device)
            run[overlap] = dict(losses=losses, deferred=deferred, host_s=host_s, params=engine.state_dict_full(),
                                staged=engine.sharded_optim.host_step.staging is not None)
            engine.close()
        out.append(run)
    return out


def _assert_same(results: list[dict], device: str = "cpu") -> None:
    for setting, run in zip(SETTINGS, results):
        plain, overlapped = run[False], run[True]
        assert overlapped["losses"] == plain["losses"], setting
        assert plain["params"].keys() == overlapped["params"].keys()
        for name, value in plain["params"].items():
            assert torch.equal(value, overlapped["params"][name]), (setting, name)
        assert overlapped["deferred"] == [True] * STEPS, setting  # the step really ran behind the next forward
        if device == "cpu":  # on a GPU both stage every compute copy bound for the device
            assert overlapped["staged"] == setting.get("staged", False) and not plain["staged"], setting
        assert plain["deferred"] == [False] * STEPS, setting
        # the plain step reports its own host time; the overlapped one, the previous step's (none before step 2)
        assert all(s > 0 for s in plain["host_s"]), plain["host_s"]
        assert overlapped["host_s"][0] == 0.0 and all(s > 0 for s in overlapped["host_s"][1:]), overlapped["host_s"]


def test_overlapped_step_is_the_plain_step_bit_for_bit():
    _assert_same(_compare(0, 1))


@pytest.mark.timeout(300)
def test_overlapped_step_is_the_plain_step_bit_for_bit_on_two_ranks():
    _assert_same(run_distributed(_compare, 2, timeout=280)[0])


def _compare_speculated(rank: int, world: int, device: str = "cpu") -> list[dict]:
    out = []
    for setting in SPECULATED:
        run = {}
        for speculate in (False, True):
            engine = make_engine(**setting, overlap=speculate, speculate=speculate, device=device)
            losses, _, _ = train(engine, rank, world, device)
            host_step = engine.sharded_optim.host_step
            run[speculate] = dict(losses=losses, params=engine.state_dict_full(), chunks=len(host_step.spares),
                                  stood=host_step.stood, redone=host_step.redone)
            engine.close()
        out.append(run)
    return out


def _assert_speculated_same(results: list[dict]) -> None:
    for setting, run in zip(SPECULATED, results):
        plain, speculated = run[False], run[True]
        assert speculated["losses"] == plain["losses"], setting
        for name, value in plain["params"].items():
            assert torch.equal(value, speculated["params"][name]), (setting, name)
        assert speculated["chunks"] > 0 and plain["chunks"] == 0, setting
        # every trainable chunk was stepped ahead each step, and each stood or was taken again
        ahead = 0 if setting.get("offload_param", True) and setting.get("stage", 3) == 3 else STEPS
        assert speculated["stood"] + speculated["redone"] == ahead * speculated["chunks"], (setting, speculated)
        if setting["clip"] is None or setting["clip"] >= 100.0:
            assert speculated["redone"] == 0, (setting, speculated)
    assert any(run[True]["redone"] for run in results)  # the clip made some step again: that path ran too


def test_speculative_step_is_the_plain_step_bit_for_bit():
    _assert_speculated_same(_compare_speculated(0, 1))


@pytest.mark.timeout(300)
def test_speculative_step_is_the_plain_step_bit_for_bit_on_two_ranks():
    _assert_speculated_same(run_distributed(_compare_speculated, 2, timeout=280)[0])


def _train_changing_lr(engine, when: str) -> tuple[list[float], dict]:
    """Losses and final params of a run whose learning rate changes every step, `when` "after step": right after
    engine.step() (an LR schedule, where the Trainer steps one), or "before step": between the last backward and
    engine.step() (build-nanogpt's loop sets it there)."""
    losses = []
    for i, step in enumerate(batches(1)):
        for j, micro in enumerate(step):
            tokens = micro[0]
            loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            losses.append(loss.item())
            boundary = j == len(step) - 1
            if boundary and when == "before step":
                engine.optimizer.param_groups[0]["lr"] = 1e-3 * (i + 2)
            engine.step()
            if boundary and when == "after step":
                engine.optimizer.param_groups[0]["lr"] = 1e-3 * (i + 2)
            engine.zero_grad()
    return losses, engine.state_dict_full()


@pytest.mark.parametrize("when", ["after step", "before step"])
def test_a_learning_rate_changed_around_step_is_the_plain_steps(when):
    """The worker steps with the hyperparameters engine.step() was called with: not a schedule's next rate set
    while the overlapped step still runs, nor the rate a speculative step took during backward when the loop sets
    another before engine.step() (that step is taken again)."""
    setting = dict(precision="bf16", clip=None, offload_param=False)
    runs = {}
    for overlap, speculate in ((False, False), (True, False), (True, True)):
        engine = make_engine(**setting, overlap=overlap, speculate=speculate)
        runs[overlap, speculate] = _train_changing_lr(engine, when)
        host_step = engine.sharded_optim.host_step
        if speculate:
            stepped_ahead = STEPS * len(host_step.spares)
            assert (host_step.stood, host_step.redone) == ((stepped_ahead, 0) if when == "after step"
                                                           else (0, stepped_ahead)), when
        engine.close()
    plain = runs[False, False]
    for key, (losses, params) in runs.items():
        assert losses == plain[0], key
        for name, value in plain[1].items():
            assert torch.equal(value, params[name]), (key, name)


def _train_reading_between(engine, device: str = "cpu") -> tuple[list, dict]:
    """A loop that reads the model where the step's work is in flight: an evaluation forward between the step's
    last backward and engine.step() (the chunks stepped ahead during that backward), through the module and through
    the engine, then the module's parameters right after engine.step() (the host step behind the next forward),
    through `module.state_dict()` and through `parameters()` after `engine.finish_step()`."""
    seen, probe = [], batches(1)[0, 0, 0].to(device)
    for step in batches(1):
        for j, micro in enumerate(step):
            tokens = micro[0].to(device)
            loss = GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:])
            engine.backward(loss)
            seen.append(loss.item())
            if j == len(step) - 1:
                with torch.no_grad():
                    for forward in (engine.module, engine):
                        seen.append(GPTLMLoss(shift=False)(forward(probe[:, :-1]), probe[:, 1:]).item())
            if engine.step() is not None:
                seen.append({k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()})
                engine.finish_step()
                seen.append([p.detach().cpu().clone() for p in engine.module.parameters()])
            engine.zero_grad()
    return seen, engine.state_dict_full()


def _compare_reading_between(rank: int, world: int, device: str = "cpu") -> list[tuple]:
    out = []
    for setting in (dict(precision="bf16", clip=None, stage=2), dict(precision="bf16", clip=1.0, stage=0),
                    dict(precision="bf16", clip=None, offload_param=False, staged=True)):
        runs = {}
        for overlap, speculate in ((False, False), (True, False), (True, True)):
            engine = make_engine(**setting, overlap=overlap, speculate=speculate, device=device)
            runs[overlap, speculate] = _train_reading_between(engine, device)
            engine.close()
        out.append((setting, runs))
    return out


def _assert_read_the_plain_steps(results: list[tuple]) -> None:
    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    for setting, runs in results:
        plain = runs[False, False]
        for key, run in runs.items():
            assert same(run[0], plain[0]), (setting, key)
            assert same(run[1], plain[1]), (setting, key)


def test_what_a_loop_reads_between_backward_step_and_forward_is_the_plain_steps():
    """A forward after the step's last backward sees the parameters as they were (the steps taken ahead are dropped
    and taken at step()); right after step() the module's state_dict and, after finish_step(), its parameters are
    the new ones."""
    _assert_read_the_plain_steps(_compare_reading_between(0, 1))


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_what_a_loop_reads_between_backward_step_and_forward_is_the_plain_steps_on_a_gpu():
    """The same on a GPU: a dropped speculative step's copy, queued on the worker's stream, lands before the
    shard is written again from the state."""
    _assert_read_the_plain_steps(run_distributed(_compare_reading_between, 1, "cuda", timeout=580,
                                                 backend="nccl")[0])


def test_a_speculative_run_resumes_bit_for_bit(tmp_path):
    """Checkpoints hold the state the speculative steps committed (never a spare set): a run saved after 2 steps and
    resumed in a fresh engine ends where the uninterrupted run does."""
    setting = dict(precision="bf16", clip=100.0, offload_param=False)  # a clip no norm reaches: the steps stand

    def steps(engine, data):
        for step in data:
            for micro in step:
                tokens = micro[0]
                engine.backward(GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:]))
                engine.step()
            engine.zero_grad()

    data = batches(1)
    whole = make_engine(**setting, overlap=True, speculate=True)
    steps(whole, data)
    first = make_engine(**setting, overlap=True, speculate=True)
    steps(first, data[:2])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = make_engine(**setting, overlap=True, speculate=True)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    steps(resumed, data[2:])
    assert resumed.sharded_optim.host_step.stood > 0  # the resumed run stepped ahead too
    for (name, a), b in zip(whole.state_dict_full().items(), resumed.state_dict_full().values()):
        assert torch.equal(a, b), name
    whole.close()
    resumed.close()


def test_a_backward_whose_step_is_not_taken_leaves_the_params_as_they_were():
    """zero_grad() after backward, with no step() (a skipped batch): the speculative steps are dropped and every
    param shard holds its state's value again."""
    engine = make_engine("bf16", None, offload_param=False, overlap=True, speculate=True)
    before = engine.state_dict_full()
    tokens = batches(1)[0, 0, 0]
    for _ in range(ACCUM):
        engine.backward(GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:]))
    assert engine.sharded_optim.host_step.speculated  # stepped ahead during the last backward
    engine.zero_grad()
    assert not engine.sharded_optim.host_step.speculated
    for name, value in engine.state_dict_full().items():
        assert torch.equal(value, before[name]), name
    engine.close()


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_speculative_step_is_the_plain_step_bit_for_bit_on_a_gpu():
    """The gradient copies' events, the worker's stream and the spare sets in pinned memory: same bits."""
    _assert_speculated_same(run_distributed(_compare_speculated, 1, "cuda", timeout=580, backend="nccl")[0])


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_overlapped_step_is_the_plain_step_bit_for_bit_on_a_gpu():
    """The worker's staged copies on its own stream, the compute stream waiting for each chunk's: same bits."""
    _assert_same(run_distributed(_compare, 1, "cuda", timeout=580, backend="nccl")[0], "cuda")


def test_an_error_in_the_worker_surfaces_at_the_next_forward():
    engine = make_engine("bf16", 1.0, overlap=True)
    tokens = batches(1)[0, 0, 0]
    for _ in range(ACCUM):
        engine.backward(GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:]))
    state = next(iter(engine.sharded_optim.states.values()))

    def broken(*args, **kwargs):
        raise RuntimeError("host step failed")

    state.optimizer.step = broken
    engine.step()
    engine.zero_grad()
    with pytest.raises(RuntimeError, match="host step failed"):
        engine(tokens[:, :-1])
    engine.close()


def test_checkpoint_and_consolidation_wait_for_the_step(tmp_path):
    engine = make_engine("bf16", 1.0, overlap=True)
    tokens = batches(1)[0, 0, 0]
    for _ in range(ACCUM):
        engine.backward(GPTLMLoss(shift=False)(engine(tokens[:, :-1]), tokens[:, 1:]))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not engine.sharded_optim.host_step.pending and all(c.pending_step is None for c in engine.chunks)
    engine.close()
