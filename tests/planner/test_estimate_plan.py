"""zerogpt_tools.estimate --plan auto prints the choice without training; DOES NOT FIT names the flags that fit."""
import pytest

from zerogpt_tools.estimate import main


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_plan_auto_prints_the_table_and_the_chosen_flags(capsys):
    code, out = run(capsys, "--model", "gpt2_xl", "--plan", "auto", "--tokens-per-step", "65536", "--gpu-mem",
                    "24GiB", "--host-mem", "64GiB", "--gpu", "4090")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("plan='auto': 1,557.7M params, 65,536 tokens/step (seq 1024, world 1, bf16)")
    assert any(line.startswith("*  ") for line in lines)
    chosen = lines[-1]
    assert chosen.startswith("chosen: --stage ") and "--offload cpu" in chosen  # 24 GiB cannot hold the state


def test_a_flag_given_stays_fixed(capsys):
    code, out = run(capsys, "--model", "gpt2_xl", "--plan", "auto", "--stage", "3", "--tokens-per-step", "65536",
                    "--gpu-mem", "24GiB", "--host-mem", "64GiB")
    assert code == 0 and out.splitlines()[-1].startswith("chosen: --stage 3 ")


def test_a_flag_that_leaves_nothing_is_named(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "gpt2_xl", "--plan", "auto", "--offload", "none", "--tokens-per-step", "65536",
              "--gpu-mem", "24GiB", "--host-mem", "64GiB"])
    assert str(e.value).startswith("error: --offload 'none' (given) leaves no plan that fits")


def test_does_not_fit_names_the_offload_flags_that_would(capsys):
    code, out = run(capsys, "--model", "gpt2_xl", "--stage", "3", "--batch", "8", "--grad-accum", "8", "--gpu-mem",
                    "24GiB", "--host-mem", "64GiB")
    assert code == 1
    assert "DOES NOT FIT" in out
    last = out.splitlines()[-1]
    assert last.startswith("fits with: --stage ") and "--offload cpu" in last
    assert "--batch" in last and "--grad-accum" in last  # the same 65,536 tokens per step, split to fit


def test_does_not_fit_and_nothing_would_says_the_smallest_change(capsys):
    code, out = run(capsys, "--model", "llama3_8b", "--seq-len", "8192", "--batch", "8", "--gpu-mem", "24GiB",
                    "--host-mem", "64GiB")
    assert code == 1
    assert out.splitlines()[-1].startswith("plan='auto': nothing fits: 8.030B params")
    assert "smallest change that fits: more host RAM" in out.splitlines()[-1]


def test_a_batch_given_beside_tokens_per_step_stays_fixed(capsys):
    """--batch 2 beside --tokens-per-step was dropped (the chosen plan took --batch 8), --grad-accum kept: the flag
    is fixed as BATCH_SIZE beside TOKENS_PER_STEP is in a config; alone, --batch only sizes the tokens per step."""
    code, out = run(capsys, "--model", "gpt2_small", "--plan", "auto", "--tokens-per-step", "8192", "--batch", "2",
                    "--gpu-mem", "80GiB")
    assert code == 0 and " --batch 2 --grad-accum 4 " in out.splitlines()[-1]


def test_the_numbers_for_a_plan_are_the_planners_for_the_config(capsys):
    """The tool's --chunked-loss counted 256-token chunks where the model (and so the planner and preflight) has
    1024: its numbers and its --plan auto choice were another plan's."""
    import json

    from model_zoo.gpt import SIZES, GPTConfig, gpt2_small
    from zerogpt.config import Config
    from zerogpt.memory_model import ModelShape
    from zerogpt.planner.auto import choose_plan
    from zerogpt.planner.speed import default_constants
    from zerogpt_tools.estimate import plan_flags
    from tests.planner.shapes import gpu

    machine = gpu(4, 64)
    model_config = GPTConfig(**SIZES["gpt2_small"])
    cfg = Config(plan="auto", SEQ_LEN=1024, TOKENS_PER_STEP=16 * 1024, precision="bf16", model=dict(type=gpt2_small),
                 optimizer=dict(type="HybridAdam", lr=1e-3)).validate()
    chosen = choose_plan(cfg, ModelShape.from_config(model_config), 1, machine, default_constants(machine),
                         model_config=model_config, log=lambda _: None).chosen
    assert chosen.plan.chunked_loss
    code, out = run(capsys, "--model", "gpt2_small", "--seq-len", "1024", "--json", *plan_flags(chosen.plan).split())
    assert json.loads(out)["totals"]["device"] == chosen.need["device"]
    code, out = run(capsys, "--model", "gpt2_small", "--plan", "auto", "--tokens-per-step", str(16 * 1024),
                    "--gpu-mem", "4GiB", "--host-mem", "64GiB", "--gpu", machine.name)
    assert out.splitlines()[-1] == f"chosen: {plan_flags(chosen.plan)}"


def test_a_capacity_not_given_is_said_unbounded(capsys):
    """Without --host-mem the host has no limit; the line said 'host RAM 4294967296.0 GiB'."""
    main(["--model", "gpt2_small", "--plan", "auto", "--gpu-mem", "24GiB"])
    out = capsys.readouterr().out
    assert "host RAM unbounded for 1 rank(s)" in out and "4294967296" not in out
