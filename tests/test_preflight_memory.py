"""zerogpt/preflight_memory.py: a run whose model state cannot fit the host's RAM or the offload disk is refused
before anything is built, in one line with both numbers and the fix (issue 30 point 5)."""
import os
import time

import pytest
import torch

import train_gpt
from model_zoo.gpt import GPT, GPTConfig, gpt2_xl
from zerogpt import preflight_memory
from zerogpt.config import Config
from zerogpt.preflight import PreflightError

GIB = 2**30
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def largest_model_config(layers: int) -> Config:
    """The gpu-results "Largest model" run: hidden 2560, stage 3, parameters and Adam state on the host, bf16."""
    return Config(dict(BATCH_SIZE=4, SEQ_LEN=1024, precision="bf16",
                       zero=dict(stage=3, offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu")),
                       model=dict(type=gpt2_xl, n_layer=layers, n_embd=2560, n_head=20)))


def on_meta(layers: int):
    def build():
        with torch.device("meta"):
            return GPT(GPTConfig(n_layer=layers, n_embd=2560, n_head=20))
    return build


def test_host_too_small_is_refused_with_both_numbers_and_the_fix(monkeypatch):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (60 * GIB, "MemAvailable"))
    with pytest.raises(PreflightError) as e:
        preflight_memory.check_memory(largest_model_config(69), 1, on_meta(69), on_gpu=True)
    msg = str(e.value)
    assert "\n" not in msg
    # 5.56B params x (2 bf16 param + 2 bf16 grad as it crossed + 4 master + 8 Adam) bytes on the host = 82.9 GiB
    assert "needs at least 82.9 GiB" in msg and "60.0 GiB is available (MemAvailable)" in msg, msg
    assert "zero.offload_optimizer.device=disk" in msg and "--set model.n_layer=" in msg, msg
    fit = int(msg.split("model.n_layer=")[1].split()[0])
    assert 40 <= fit < 69
    result = preflight_memory.check_memory(largest_model_config(fit), 1, on_meta(fit), on_gpu=True)
    assert result["host"][0] <= 60 * GIB                      # the layer count it names does fit


def test_bf16_moments_take_4_bytes_per_param_off_the_host(monkeypatch):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (80 * GIB, "MemAvailable"))
    cfg = largest_model_config(69)
    with pytest.raises(PreflightError, match="zero.offload_optimizer.state_dtype=bf16"):
        preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)
    cfg.zero["offload_optimizer"] = dict(device="cpu", state_dtype="bf16")
    need, _ = preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)["host"]
    assert 62 * GIB < need < 70 * GIB  # 5.56B x 12 bytes (2 bf16 param + 2 grad + 4 master + 4 moments) + buffers


def test_what_fits_passes_and_disk_offload_moves_the_state_off_the_host(monkeypatch, tmp_path):
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (126 * GIB, "MemAvailable"))
    need, available = preflight_memory.check_memory(largest_model_config(48), 1, on_meta(48), on_gpu=True)["host"]
    assert need < available
    cfg = largest_model_config(69)
    cfg.zero["offload_optimizer"] = dict(device="disk", path=str(tmp_path))
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (60 * GIB, "MemAvailable"))
    monkeypatch.setattr(preflight_memory, "free_disk_bytes", lambda path: 10 * GIB)
    with pytest.raises(PreflightError, match=r"^disk: this run writes 62.\d GiB of optimizer state .* but it has "
                                             r"10.0 GiB free; point zero.offload_optimizer.path"):
        preflight_memory.check_memory(cfg, 1, on_meta(69), on_gpu=True)   # host: 6 B/param, fits in 60 GiB


def test_available_memory_is_the_kernels():
    available, source = preflight_memory.available_host_bytes()
    assert 0 < available < 2**50 and (source == "MemAvailable" or source.startswith("cgroup"))


def test_train_gpt_ends_in_seconds_with_the_line(tmp_path, monkeypatch, capsys):
    """An artificially low limit: GPT-2 XL on 4 GiB of host RAM is refused before any process group or file."""
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (4 * GIB, "MemAvailable"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = ["--config", os.path.join(CONFIGS, "gpt2_xl_zero3_offload.py"), "--set", "data.mock=True",
            "--set", f"train.output_dir={tmp_path / 'run'}"]
    start = time.perf_counter()
    assert train_gpt.main(argv) == 1
    assert time.perf_counter() - start < 20
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: host memory: this run needs at least "), err
    assert "GiB is available (MemAvailable); keep Adam's moments in bf16" in err[0], err
    assert "or put the optimizer state on disk" in err[0], err
    assert not (tmp_path / "run").exists()


def test_compile_counts_a_block_gathered_whole(monkeypatch):
    """compile = True at stage 3: the chunk buffers are a whole block's plus the next `prefetch` modules'
    (memory_model.buffer_bytes(gather_per_block=True)), with the config's chunk size; on a CPU run (every home
    but disk is host RAM) the need grows by exactly that difference, under tensor parallelism too."""
    from zerogpt.memory_model import ModelShape, buffer_bytes
    from zerogpt.zero import TensorShardStrategy

    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (2**50, "MemAvailable"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def need(compile_: bool, tensor: int = 1) -> int:
        cfg = Config(dict(BATCH_SIZE=1, SEQ_LEN=16, precision="fp32", compile=compile_,
                          parallel=dict(tensor=dict(size=tensor)),
                          zero=dict(stage=3, shard_strategy=TensorShardStrategy(), prefetch=2)))

        def build():
            with torch.device("meta"):
                return GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, vocab_size=128, max_position_embeddings=16))
        # 2 data-parallel ranks (at one, each shard is its whole chunk: nothing is gathered)
        return preflight_memory.check_memory(cfg, 2 * tensor, build, on_gpu=False)["host"][0]

    shape = ModelShape(layers=4, hidden=64, heads=2, vocab=128, positions=16, pad_vocab_multiple=1)
    eager, whole = (buffer_bytes(shape, 3, 2, "fp32", "none", 2, 0, gather_per_block=g, offload_param="none")["device"]
                    for g in (0, 1))
    assert whole > eager
    assert need(True) - need(False) == 2 * (whole - eager)  # two ranks on this host
    assert need(True, tensor=2) - need(False, tensor=2) == 4 * (whole - eager)


def llama3_8b_config(state_dtype: str = "fp32", model_type=None) -> Config:
    """Llama-3.1-8B on one GPU: stage 3, parameters and Adam state on the host, bf16 (as its shipped config)."""
    from model_zoo.llama import llama3_8b

    return Config(dict(BATCH_SIZE=8, SEQ_LEN=8192, precision="bf16",
                       zero=dict(stage=3, offload_param=dict(device="cpu"),
                                 offload_optimizer=dict(device="cpu", state_dtype=state_dtype)),
                       model=dict(type=model_type or llama3_8b, checkpoint=True, chunked_loss=True)))


def llama3_8b_on_meta():
    from model_zoo.llama import llama3_8b

    with torch.device("meta"):
        return llama3_8b(checkpoint=True, chunked_loss=True)


def test_llama3_8b_with_fp32_moments_is_refused_and_bf16_moments_fit(monkeypatch):
    """8.03B params x 16 bytes (2 bf16 param + 2 bf16 grad + 4 master + 8 fp32 Adam) = 119.7 GiB of host RAM: more
    than a 128 GB host's MemAvailable; with bf16 moments, 12 bytes = 89.7 GiB, fits. The shape comes from the
    LlamaConfig (duck-typed) and the fewer-layers fix names its key."""
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (115 * GIB, "MemAvailable"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(PreflightError) as e:
        preflight_memory.check_memory(llama3_8b_config(), 1, llama3_8b_on_meta, on_gpu=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs at least 119.7 GiB" in msg and "8.03B params per rank" in msg and "(fp32 moments)" in msg, msg
    assert "--set zero.offload_optimizer.state_dtype=bf16" in msg and "--set model.num_hidden_layers=" in msg, msg
    fit = int(msg.split("model.num_hidden_layers=")[1].split()[0])
    assert 20 < fit < 32
    need, _ = preflight_memory.check_memory(llama3_8b_config("bf16"), 1, llama3_8b_on_meta, on_gpu=True)["host"]
    assert need == 12 * 8_030_261_248  # the host holds model state only: the chunk buffers are on the GPU


def test_a_hugging_face_checkpoints_depth_is_not_offered_as_a_fix(monkeypatch):
    """model = dict(type="hf", path=DIR): the checkpoint fixes the layer count, so fewer layers is no fix."""
    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (100 * GIB, "MemAvailable"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = llama3_8b_config(model_type="hf")
    cfg.model["path"] = "checkpoints/Meta-Llama-3.1-8B"
    with pytest.raises(PreflightError) as e:
        preflight_memory.check_memory(cfg, 1, llama3_8b_on_meta, on_gpu=True)
    assert "needs at least 119.7 GiB" in str(e.value) and "num_hidden_layers" not in str(e.value)
    assert "state_dtype=bf16" in str(e.value)


def test_llama_activations_count_on_a_cpu_run(monkeypatch):
    """On the CPU the activations are host RAM too: a Llama's (SwiGLU, GQA) from memory_model, with the config's
    checkpointing and chunked loss."""
    from model_zoo.llama import Llama, LlamaConfig
    from zerogpt.memory_model import ModelShape, activation_bytes

    monkeypatch.setattr(preflight_memory, "available_host_bytes", lambda: (2**50, "MemAvailable"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    llama = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, checkpoint=True, chunked_loss=True,
                        loss_chunk_size=16)

    def need(batch: int) -> int:
        # accumulation 2: the first micro-step's gradients are held through the next forward, so the activations
        # add to them in full (at accumulation 1 memory_model.grads_activations_overlap takes the smaller off)
        cfg = Config(dict(BATCH_SIZE=batch, SEQ_LEN=64, precision="fp32", zero=dict(stage=2), GRADIENT_ACCUMULATION=2))

        def build():
            with torch.device("meta"):
                return Llama(llama)
        return preflight_memory.check_memory(cfg, 1, build, on_gpu=False)["host"][0]

    shape = ModelShape.from_config(llama)
    acts = {b: activation_bytes(shape, 64, b, "fp32", checkpoint=True, loss_chunk=16)["total"] for b in (1, 2)}
    assert need(2) - need(1) == acts[2] - acts[1] > 0
