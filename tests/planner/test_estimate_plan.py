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
