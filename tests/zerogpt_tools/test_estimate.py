"""zerogpt_tools.estimate: ZeRO formulas against hand-computed numbers, activations, model table, CLI."""
import json
import subprocess
import sys

import pytest
import torch

from zerogpt_tools.estimate import MODELS, ModelShape, activation_bytes, estimate, main, model_state_bytes
from zerogpt.context import DistContext

PSI, N = 10**6, 4


def on(plan: dict, home: str) -> int:
    return sum(plan[cat][home] for cat in plan)


@pytest.mark.parametrize("stage, world, precision, expected", [
    (0, N, "fp32", 16 * PSI),                        # ZeRO paper 16Psi (fp32: master aliases the param)
    (0, N, "bf16", 18 * PSI),                        # 16Psi + fp32 grad buffer (2 B more per param)
    (1, N, "bf16", 4 * PSI + 12 * PSI // N),         # 4Psi + 12Psi/N: full bf16 grads dominate the shards
    (2, N, "bf16", 2 * PSI + 16 * PSI // N),         # 2Psi + 16Psi/N: fp32 grad shards
    (3, N, "bf16", 18 * PSI // N),                   # 18Psi/N (paper 16Psi/N with fp16 grad shards)
    (3, N, "fp32", 16 * PSI // N),                   # 16Psi/N
    (1, 1, "fp16", 18 * PSI),                        # N=1: stage 1 = stage 0
])
def test_zero_formulas_on_device(stage, world, precision, expected):
    plan = model_state_bytes(PSI, stage, world, precision)
    assert on(plan, "device") == expected
    assert on(plan, "host") == on(plan, "disk") == 0


def test_breakdown_stage2_bf16():
    plan = model_state_bytes(PSI, 2, N, "bf16")
    assert plan["params"]["device"] == 2 * PSI
    assert plan["grads"]["device"] == 4 * PSI // N
    assert plan["master"]["device"] == 4 * PSI // N
    assert plan["optimizer"]["device"] == 8 * PSI // N


def test_optimizer_offload_cpu_and_disk():
    # the step's one crossing stays on the host in bf16: grads(2) + master(4) + Adam(8)
    cpu = model_state_bytes(PSI, 3, 1, "bf16", offload_optimizer="cpu")
    assert on(cpu, "device") == 2 * PSI and on(cpu, "host") == 14 * PSI
    # summed over micro-steps (on the device at stages 2-3, with the params there): fp32 on both sides
    accumulated = model_state_bytes(PSI, 3, 1, "bf16", offload_optimizer="cpu", accumulation=4)
    assert accumulated["grads"] == {"device": 4 * PSI, "host": 4 * PSI, "disk": 0}
    disk = model_state_bytes(PSI, 2, N, "bf16", offload_optimizer="disk")
    assert on(disk, "device") == 2 * PSI
    assert disk["grads"]["host"] == 2 * PSI // N
    assert model_state_bytes(PSI, 2, N, "fp16", offload_optimizer="cpu")["grads"]["host"] == 2 * PSI // N
    assert on(disk, "disk") == 12 * PSI // N
    # fp32 with the optimizer off the device keeps its own master copy there
    fp32 = model_state_bytes(PSI, 3, N, "fp32", offload_optimizer="cpu")
    assert fp32["master"]["host"] == 4 * PSI // N and on(fp32, "device") == 4 * PSI // N


def test_param_offload_and_errors():
    plan = model_state_bytes(PSI, 3, N, "bf16", offload_optimizer="cpu", offload_param="cpu")
    assert on(plan, "device") == 0 and on(plan, "host") == 16 * PSI // N  # params 2, grads 2, master 4, Adam 8
    with pytest.raises(ValueError, match="stage 3"):
        model_state_bytes(PSI, 2, N, offload_param="cpu")
    with pytest.raises(ValueError, match="precision"):
        model_state_bytes(PSI, 2, N, precision="int8")


def test_model_table_matches_model_zoo():
    from model_zoo import gpt, llama

    for family, names in ((gpt, ("gpt2_tiny", "gpt2_small", "gpt2_xl")),
                          (llama, ("llama_tiny", "llama3_8b", "qwen2_5_7b", "qwen3_0_6b", "mistral_7b"))):
        for name in names:
            with torch.device("meta"):
                model = getattr(family, name)()
            assert MODELS[name].num_params == sum(p.numel() for p in model.parameters()), name
    assert set(MODELS) == set(gpt.SIZES) | set(llama.SIZES)


def test_activations_korthikanti():
    shape = ModelShape(layers=3, hidden=16, heads=2, vocab=100, positions=8)
    s, b, h, a = 8, 2, 16, 2
    eager = activation_bytes(shape, s, b, "bf16", flash=False, dropout=True)
    assert eager["per_layer"] == 34 * s * b * h + 5 * a * s * s * b  # the paper's formula, 2-byte activations
    flash = activation_bytes(shape, s, b, "bf16")
    assert flash["per_layer"] == 32 * s * b * h  # no s^2 scores, no dropout masks
    ckpt = activation_bytes(shape, s, b, "bf16", checkpoint=True)
    assert ckpt["layers"] == 3 * 2 * s * b * h + flash["per_layer"]
    assert ckpt["total"] < flash["total"]
    assert activation_bytes(shape, s, b, "fp32")["per_layer"] == 2 * flash["per_layer"]


def test_estimate_totals_add_up():
    est = estimate(MODELS["gpt2_small"], 3, 2, "bf16", offload_optimizer="cpu", gpu_overhead=0)
    states = est["model_states"]
    assert est["totals"]["device"] == (on(states, "device") + est["activations"]["total"]
                                       + est["buffers"]["device"] - est["overlap"])  # grads_activations_overlap
    assert est["totals"]["host"] == on(states, "host")


def test_cli_fits_and_json(capsys):
    assert main(["--model", "gpt2_xl", "--stage", "3", "--offload", "cpu", "--world", "1",
                 "--gpu-mem", "80GB", "--host-mem", "128GB"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "16Psi/N" in out and "activations" in out
    # 1.5B params with everything on one 24 GB GPU does not fit: exit code 1 and says so
    assert main(["--model", "gpt2_xl", "--stage", "0", "--gpu-mem", "24GB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "1000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "custom" and plan["num_params"] == ModelShape(2, 64, 2, 1000).num_params
    with pytest.raises(SystemExit, match="stage 3"):
        main(["--stage", "2", "--offload-param", "cpu"])
    with pytest.raises(SystemExit, match="prefetch must be an int >= 0"):
        main(["--model", "gpt2_xl", "--stage", "3", "--prefetch", "-1"])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a capacity without its unit is bytes: refused, not "DOES NOT FIT"
        main(["--model", "gpt2_xl", "--gpu-mem", "80"])
    assert "'80' is 80 bytes; give the unit, e.g. 80GiB" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_cli_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "zerogpt_tools.estimate", "--model", "gpt2_tiny", "--stage", "2",
                          "--world", "2", "--precision", "fp32", "--checkpoint"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "2Psi+14Psi/N" in res.stdout


# -- the estimate against the engine's own accounting on real small models ------------------------------

ESTIMATE_SETTINGS = [(stage, precision, offload, "none") for stage in range(4) for precision in ("fp32", "bf16")
                     for offload in ("none", "cpu", "disk")]
ESTIMATE_SETTINGS += [(3, precision, offload, "cpu") for precision in ("fp32", "bf16") for offload in ("none", "cpu")]


def _measured_peaks(rank: int, world: int, disk_path: str) -> dict:
    """Per setting: the engine's memory_stats() peak per category and home over one accumulated step.

    Snapshots after each backward and after the step: stages 0/1 hold full grads while accumulating and
    fp32 grad shards at the boundary, the optimizer state appears at the first step; the estimate is
    the peak of each (category, home).
    """
    import zerogpt
    from model_zoo import GPTLMLoss, gpt2_tiny
    from zerogpt.zero import BucketTensorShardStrategy

    out = {}
    for stage, precision, offload, offload_param in ESTIMATE_SETTINGS:
        torch.manual_seed(0)
        model = gpt2_tiny(vocab_size=256, max_position_embeddings=16)
        num_params = sum(p.numel() for p in model.parameters())  # before stage 3 empties them
        zero = dict(stage=stage, shard_strategy=BucketTensorShardStrategy(bucket_mb=0.05),
                    offload_optimizer=dict(device=offload, path=disk_path), offload_param=dict(device=offload_param))
        cfg = zerogpt.Config(dict(zero=zero, precision=precision, GRADIENT_ACCUMULATION=2))
        engine = zerogpt.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg,
                                    ctx=DistContext.current())
        tokens = torch.randint(0, 256, (2, 2, 17), generator=torch.Generator().manual_seed(rank))
        peak = {c: dict.fromkeys(("device", "host", "disk"), 0) for c in ("params", "grads", "master", "optimizer")}

        def snapshot() -> None:
            for category, homes in engine.memory_stats().items():
                for home, nbytes in homes.items():
                    peak[category][home] = max(peak[category][home], nbytes)

        for x in tokens:
            engine.backward(GPTLMLoss(shift=False)(engine(x[:, :-1]), x[:, 1:]))
            snapshot()
            engine.step()
            snapshot()
        out[(stage, precision, offload, offload_param)] = dict(
            peak=peak, num_params=num_params, num_chunks=len(engine.chunks))
        engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_estimate_matches_engine_memory_stats(world, tmp_path):
    """model_state_bytes() == engine.memory_stats() for stages 0-3 x fp32/bf16 x offload none/cpu/disk
    (+ stage-3 param offload), within chunk padding: each chunk pads to a multiple of the world size,
    i.e. < world elements per chunk in a full buffer and < 1 element per chunk in a shard."""
    from tests.dist_utils import run_distributed

    results = run_distributed(_measured_peaks, world, str(tmp_path), timeout=280)
    for rank, measured in enumerate(results):
        for (stage, precision, offload, offload_param), m in measured.items():
            plan = model_state_bytes(m["num_params"], stage, world, precision, offload, offload_param,
                                     accumulation=2)
            tolerance = m["num_chunks"] * world * 8  # padding elements x the widest element (Adam: 2 x fp32)
            what = f"stage {stage} {precision} offload={offload} param={offload_param} world {world} rank {rank}"
            for category, homes in plan.items():
                for home, expected in homes.items():
                    got = m["peak"][category][home]
                    assert (got == 0) == (expected == 0) and abs(got - expected) <= tolerance, (
                        f"{what}: {category} on {home}: engine {got} B, estimate {expected} B")


def test_cli_compile_counts_blocks_gathered_whole(capsys):
    """--compile (the config's compile = True): stage 3's chunk buffers are a block's chunks and the next
    --prefetch modules', not one chunk plus --prefetch chunks."""
    from zerogpt.memory_model import buffer_bytes

    args = ["--layers", "4", "--hidden", "64", "--heads", "2", "--vocab", "128", "--bucket-mb", "0", "--world", "2",
            "--json"]  # 2 ranks: one rank with its shards on the device gathers nothing
    plans = {}
    for extra in ([], ["--compile"]):
        assert main(args + extra) == 0
        plans[bool(extra)] = json.loads(capsys.readouterr().out)
    shape = ModelShape(**plans[True]["shape"])
    assert plans[True]["buffers"] == buffer_bytes(shape, 3, 2, "bf16", "none", 2, 0, gather_per_block=True)
    assert plans[True]["buffers"]["device"] > plans[False]["buffers"]["device"]
    assert main(args[:-1] + ["--compile"]) == 0
    assert "blocks gathered whole" in capsys.readouterr().out


LLAMA3_8B = ["--model", "llama3_8b", "--offload", "cpu", "--offload-param", "cpu", "--gpu-mem", "80GiB"]


def test_cli_llama3_8b_on_one_gpu_fits_128gb_with_bf16_moments_only(capsys):
    """Llama-3.1-8B (8.03B) at stage 3 with params and optimizer on the host: 16 B/param = 119.66 GiB of host RAM
    with fp32 Adam moments, more than 128 GB (119.21 GiB), and the report says what bf16 moments need instead;
    with them 12 B/param = 89.75 GiB fits. The optimizer state dominates the host."""
    psi = 8_030_261_248
    assert main(LLAMA3_8B + ["--host-mem", "128GB"]) == 1
    out = capsys.readouterr().out
    assert "llama3_8b = 8.030B params (32 layers, hidden 4096, 32 q / 8 kv heads of 128, SwiGLU 14336, untied " \
           "vocab 128256)" in out
    assert f"host  : needs {16 * psi / 2**30:.2f} GiB per node (1 rank) of 119.21 GiB -> DOES NOT FIT" in out, out
    assert f"host optimizer state {8 * psi / 2**30:.2f} GiB (50%)" in out, out
    assert f"with --state-dtype bf16 (Adam's moments in bf16, zero.offload_optimizer.state_dtype=bf16): " \
           f"{12 * psi / 2**30:.2f} GiB -> FITS (75%)" in out, out
    assert main(LLAMA3_8B + ["--host-mem", "128GB", "--state-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "(bf16 moments)" in out and f"needs {12 * psi / 2**30:.2f} GiB per node (1 rank) of 119.21 GiB -> " \
        f"FITS (75%" in out, out
    # 128 GiB holds the fp32 moments on paper, leaving 8 GiB for everything else: the bf16 line is shown too
    assert main(LLAMA3_8B + ["--host-mem", "128GiB"]) == 0
    out = capsys.readouterr().out
    assert "FITS (93%, 8.34 GiB left for the OS, processes and data)" in out and "--state-dtype bf16" in out, out


def test_cli_chunked_loss_and_llama_custom_shapes(capsys):
    """--chunked-loss keeps one chunk's logits (128k vocab: 10.5 GiB less at 8192 tokens, the plain loss's backward
    peak at 12 bytes per logit against the gradients of the hidden states and the head, held from its forward, and
    one chunk's logits, 1.2 GiB); custom flags change a Llama shape and are refused on a GPT-2 one."""
    base = LLAMA3_8B + ["--seq-len", "8192", "--checkpoint", "--json"]
    plans = {}
    for extra in ([], ["--chunked-loss", "--loss-chunk-size", "256"]):
        assert main(base + extra) == 0
        plans[bool(extra)] = json.loads(capsys.readouterr().out)
    saved = plans[False]["activations"]["logits"] - plans[True]["activations"]["logits"]
    assert saved == 8192 * 128256 * 12 - (8192 + 128256) * 4096 * 2 - 256 * 128256 * (4 + 2)
    assert main(["--model", "llama3_8b", "--layers", "16", "--kv-heads", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "custom" and plan["shape"]["family"] == "llama"
    assert plan["num_params"] == ModelShape(16, 4096, 32, 128256, family="llama", kv_heads=4, ffn=14336,
                                            tied=False).num_params
    with pytest.raises(SystemExit, match="kv_heads=4 is a llama-family option"):
        main(["--model", "gpt2_xl", "--kv-heads", "4"])
    with pytest.raises(SystemExit, match=r"hidden \(64\) must be divisible by heads \(3\)"):
        main(["--layers", "2", "--hidden", "64", "--heads", "3"])


@pytest.mark.parametrize("argv, expected", [
    (["--batch", "-1"], "argument --batch: must be >= 1, got -1"),      # was: negative activations, exit 0
    (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    (["--nodes", "0"], "argument --nodes: must be >= 1, got 0"),        # was: ZeroDivisionError traceback
    (["--gpu-mem", "24XB"], "argument --gpu-mem: size: cannot read '24XB' as a size; write bytes or e.g. 500MB"),
    (["--gpu-overhead", "1QB"], "argument --gpu-overhead: size: cannot read '1QB'"),  # was: invalid _size value
])
def test_cli_refuses_counts_below_one_and_names_the_size_forms(argv, expected, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--model", "gpt2_tiny", *argv])
    assert err.value.code == 2
    assert expected in capsys.readouterr().err.splitlines()[-1]


def test_bf16_moments_without_offload_are_refused_as_the_config_refuses_them():
    """--state-dtype bf16 with the optimizer on the device printed 4 bytes/param less device memory for a plan the
    config refuses (zero.offload_optimizer.state_dtype='bf16' needs the state on the host or disk)."""
    with pytest.raises(SystemExit) as e:
        main(["--model", "gpt2_xl", "--state-dtype", "bf16"])
    assert str(e.value) == ("error: --state-dtype bf16 is for optimizer state on the host or disk (the fused host "
                            "Adam step keeps it); add --offload cpu or --offload disk")
