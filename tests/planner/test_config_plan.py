"""A config's workload and fixed keys; a chosen plan written back into the config as a hand-set file would be."""
import pytest

from model_zoo.gpt import GPTConfig, gpt2_tiny
from tests.planner.shapes import TINY
from zerogpt.config import BucketTensorShardStrategy, Config, engine_config
from zerogpt.planner.config_plan import apply_plan, workload_from_config
from zerogpt.planner.plan import Plan, PlanError
from zerogpt.planner.search import enumerate_plans

MODEL_CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=1024, max_position_embeddings=256)


def cfg(**keys) -> Config:
    base = dict(plan="auto", SEQ_LEN=128, TOKENS_PER_STEP=4 * 128, model=dict(type=gpt2_tiny),
                optimizer=dict(type="HybridAdam", lr=1e-3))
    return Config({**base, **keys}).validate()


def test_the_keys_a_config_sets_are_fixed():
    c = cfg(zero=dict(stage=3, offload_optimizer=dict(device="cpu"), shard_strategy=BucketTensorShardStrategy(64)),
            BATCH_SIZE=2, model=dict(type=gpt2_tiny, checkpoint=True))
    work = workload_from_config(c, TINY, dp=2, model_config=MODEL_CONFIG)
    assert work.fixed == dict(stage=3, offload_optimizer="cpu", bucket_mb=64.0, micro_batch=2, checkpoint=True)
    assert (work.tokens_per_step, work.world, work.samples_per_rank, work.host_adam) == (512, 2, 2, True)


def test_tokens_per_step_from_the_batch_keys_when_no_target_is_given():
    c = Config(plan="auto", SEQ_LEN=128, BATCH_SIZE=2, GRADIENT_ACCUMULATION=3, model=dict(type=gpt2_tiny)).validate()
    work = workload_from_config(c, TINY, dp=2, model_config=MODEL_CONFIG)
    assert work.tokens_per_step == 2 * 3 * 2 * 128 and "micro_batch" not in work.fixed
    g = Config(plan="auto", SEQ_LEN=128, GLOBAL_BATCH_SIZE=8, model=dict(type=gpt2_tiny)).validate()
    assert workload_from_config(g, TINY, dp=2, model_config=MODEL_CONFIG).tokens_per_step == 8 * 128


def test_the_colossalai_form_is_refused_in_one_line():
    c = cfg(zero=dict(model_config=dict(tensor_placement_policy="cpu")))
    with pytest.raises(PlanError, match=r"^plan='auto' reads zerogpt's zero keys; zero.model_config"):
        workload_from_config(c, TINY, dp=1, model_config=MODEL_CONFIG)


def test_a_model_without_the_keywords_keeps_them_off():
    work = workload_from_config(cfg(), TINY, dp=1, model_config=object())
    assert work.fixed == dict(checkpoint=False, chunked_loss=False) and not work.can_checkpoint


def test_the_plan_written_in_is_what_the_engine_reads():
    plan = Plan(stage=3, offload_optimizer="cpu", offload_param="cpu", state_dtype="bf16", micro_batch=2,
                accumulation=2, checkpoint=True, chunked_loss=True, bucket_mb=64.0, prefetch=1, device_budget=2**20)
    out = apply_plan(cfg(zero=dict(loss_scale=dict(initial_scale=1024.0))), plan)
    assert out.plan == "manual" and "TOKENS_PER_STEP" not in out
    eng = engine_config(out, world_size=1)
    z = eng.zero
    assert (z.stage, z.offload_optimizer.device, z.offload_optimizer.state_dtype, z.offload_param.device,
            z.offload_param.device_budget, z.prefetch, z.shard_strategy.bucket_mb) == (3, "cpu", "bf16", "cpu",
                                                                                      2**20, 1, 64.0)
    assert z.loss_scale.initial_scale == 1024.0  # the user's other zero keys are kept
    assert (out.BATCH_SIZE, eng.gradient_accumulation, out.model.checkpoint, out.model.chunked_loss) == \
        (2, 2, True, True)



def test_the_written_config_loads_back_as_a_hand_set_run(tmp_path):
    plan = Plan(stage=2, offload_optimizer="cpu", offload_param="none", state_dtype="fp32", micro_batch=4,
                accumulation=1, checkpoint=False, chunked_loss=False)
    path = tmp_path / "config.py"
    path.write_text(apply_plan(cfg(), plan).to_python())
    back = Config.from_file(path)
    assert back.plan == "manual" and back.zero.stage == 2 and back.BATCH_SIZE == 4


@pytest.mark.parametrize("keys, named", [(dict(BATCH_SIZE=3), "BATCH_SIZE=3"), (dict(BATCH_SIZE=8), "BATCH_SIZE=8"),
                                         (dict(GRADIENT_ACCUMULATION=3), "GRADIENT_ACCUMULATION=3"),
                                         (dict(BATCH_SIZE=2, GRADIENT_ACCUMULATION=1),
                                          "BATCH_SIZE=2 x GRADIENT_ACCUMULATION=1")])
def test_a_fixed_micro_batch_that_does_not_split_the_tokens_per_step_is_one_line(keys, named):
    """4 sequences per rank: a micro-batch of 3 made a 3 x 1 plan (3 sequences), one of 8 an 8 x 0 plan."""
    work = workload_from_config(cfg(**keys), TINY, dp=1, model_config=MODEL_CONFIG)
    with pytest.raises(PlanError, match=rf"^{named} \(fixed in the config\) does not split the 4 sequences per "
                                        rf"rank of tokens per step 512 .*; use a divisor of 4: 1, 2, 4$"):
        work.check()
    kept = workload_from_config(cfg(BATCH_SIZE=2), TINY, dp=1, model_config=MODEL_CONFIG)
    kept.check()
    assert {(p.micro_batch, p.accumulation) for p in enumerate_plans(kept)} == {(2, 2)}
