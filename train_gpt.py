"""Pretrain a GPT from a config file: config -> launch -> data -> model -> initialize -> Trainer.fit.

The CPU demo (2 ranks; tokenizes the bundled sample corpus on its first run, then trains for 1-2 minutes):
    torchrun --standalone --nproc_per_node 2 train_gpt.py --config configs/demo_cpu.py
One process, CPU or one GPU:
    python train_gpt.py --config configs/demo_cpu.py --set train.max_steps=50
8 GPUs, overriding keys, continuing from the newest checkpoint if there is one:
    torchrun --standalone --nproc_per_node 8 train_gpt.py --config configs/gpt2_small_zero2.py \\
        --set zero.stage=3 --set BATCH_SIZE=8 --resume auto

A run writes <train.output_dir>/: config.py (resolved), metrics.jsonl, tensorboard/, checkpoints/step_<N>/,
checkpoints/latest, loss.png (DESIGN §5). Under torchrun, an error on any rank is logged with its rank and
ends every rank (torchrun stops the others and prints the failing rank's traceback), never a hang.
"""
import argparse
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import zerogpt
from zerogpt.config import data_config, lr_scheduler_config, train_config
from zerogpt.optim.lr_scheduler import build_lr_scheduler
from zerogpt.trainer import (EvalHook, LogMetricByStepHook, LossHook, LRSchedulerHook, MemoryHook, NaNGuardHook,
                             PlotHook, ProgressBarHook, SaveCheckpointHook, TensorboardHook, ThroughputHook, Trainer,
                             latest_checkpoint)
from model_zoo import GPTLMLoss, build_model
import data_pipeline

# A data.path named stdlib_docs (configs/demo_cpu.py: .cache/demo/stdlib_docs) is the bundled sample corpus:
# when missing, it and its tokenizer are built from this JSONL with the pipeline's own stages.
SAMPLE = "stdlib_docs"
SAMPLE_CORPUS = os.path.join(os.path.dirname(data_pipeline.__file__), "assets", "sample", f"{SAMPLE}.jsonl")
SAMPLE_VOCAB = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Pretrain a GPT from a zerogpt config file (see the module docstring).")
    p.add_argument("--config", required=True, help="Python config file, e.g. configs/demo_cpu.py")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, repeatable: --set zero.stage=2 --set train.max_steps=100")
    p.add_argument("--resume", default=None, metavar="auto|CKPT_DIR",
                   help="'auto': continue from <output_dir>/checkpoints/latest if it exists (else start fresh); "
                        "or a checkpoint directory such as runs/x/checkpoints/step_1000")
    return p.parse_args(argv)


def is_sample(data) -> bool:
    return data.path is not None and os.path.basename(data.path) == SAMPLE and data.tokenizer is not None


def check_data(data) -> None:
    """Fail before any process starts talking when the dataset is not there, naming the command that makes it."""
    if data.mock or is_sample(data):
        return
    if data.path is None:
        raise ValueError("data.path is not set: pass --set data.path=PREFIX (a tokenized .bin/.idx dataset, "
                         "made by `python -m data_pipeline tokenize`), or --set data.mock=True for random tokens")
    missing = [f"{data.path}{ext}" for ext in (".bin", ".idx") if not os.path.exists(data.path + ext)]
    if missing:
        raise FileNotFoundError(
            f"data.path={data.path!r}: {' and '.join(missing)} not found. Create it with\n"
            f"    python -m data_pipeline tokenize CORPUS.jsonl --tokenizer TOKENIZER_DIR --output-prefix {data.path}\n"
            f"(the whole chain from URLs: README 'Data pipeline').")
    if data.tokenizer is not None and not os.path.exists(data.tokenizer):
        raise FileNotFoundError(f"data.tokenizer={data.tokenizer!r} not found; train one with "
                                f"`python -m data_pipeline train-tokenizer CORPUS.jsonl --output "
                                f"{data.tokenizer}` or point it at the tokenizer the dataset was made with")


def prepare_sample(data, ctx) -> None:
    """First use of the sample corpus: rank 0 trains its tokenizer and tokenizes it; the other ranks wait."""
    from data_pipeline.__main__ import main as pipeline
    if ctx.rank == 0 and not os.path.exists(data.path + ".idx"):
        ctx.logger.info(f"sample data: training a tokenizer on {SAMPLE_CORPUS} and tokenizing it into "
                        f"{data.path} (first run only)")
        stages = [["train-tokenizer", SAMPLE_CORPUS, "--output", data.tokenizer, "--vocab-size", str(SAMPLE_VOCAB)],
                  ["tokenize", SAMPLE_CORPUS, "--tokenizer", data.tokenizer, "--output-prefix", data.path]]
        for argv in stages if not os.path.exists(data.tokenizer) else stages[1:]:
            if pipeline(argv) != 0:
                raise RuntimeError(f"python -m data_pipeline {' '.join(argv)} failed (see its error above)")
    ctx.barrier()


class RandomTokens(torch.utils.data.Dataset):
    """data.mock=True: uniformly random (seq_len + 1)-token windows, the same for a given index (benchmarks)."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


def build_data(cfg, data, ctx):
    """Train and validation dataloaders (each rank reads its slice of every global batch) and the vocab size."""
    if data.mock:
        vocab_size = data.vocab_size or 50257
        datasets = [RandomTokens(n, cfg.SEQ_LEN, vocab_size, data.seed + i) for i, n in enumerate((1 << 24, 4096))]
    else:
        datasets = [data_pipeline.GPTDataset(data.path, cfg.SEQ_LEN, split=split, splits=data.split, seed=data.seed,
                                             vocab_size=data.vocab_size, group=ctx.group) for split in ("train", "valid")]
        # The vocabulary the data was tokenized with (tokenize records it), so the model's embedding fits it.
        vocab_size = data.vocab_size or datasets[0].meta_file.get("vocab_size") or \
            len(data_pipeline.load_tokenizer(data.tokenizer))
    loaders = []
    for ds, shuffle in zip(datasets, (not data.mock, False)):
        sampler = data_pipeline.DistributedBatchSampler(ds, cfg.BATCH_SIZE, ctx.rank, ctx.world_size,
                                                        shuffle=shuffle, seed=data.seed)
        loaders.append(torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=data.num_workers,
                                                   pin_memory=ctx.device.type == "cuda"))
    return loaders[0], loaders[1], vocab_size


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. config: a typo or a bad value fails here, before any process group exists
    cfg = zerogpt.Config.from_file(args.config).apply_overrides(args.set)
    train, data = train_config(cfg), data_config(cfg)
    if data.seed is None:
        data.seed = train.seed
    check_data(data)

    # 2. launch: process group, device, seeds, rank-aware logger
    ctx = zerogpt.launch_from_torch(cfg)
    try:
        run(cfg, train, data, ctx, args.resume)
    except Exception as e:
        # torchrun reports only the first failing rank; say here which rank failed and why, then end this rank.
        ctx.logger.error(f"training failed on rank {ctx.rank}: {type(e).__name__}: {e}")
        raise
    finally:
        ctx.destroy()
    return 0


def run(cfg, train, data, ctx, resume) -> None:
    out = train.output_dir
    if ctx.rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.py"), "w") as f:
            f.write(cfg.to_python())

    # 3. data
    if is_sample(data):
        prepare_sample(data, ctx)
    train_dl, valid_dl, vocab_size = build_data(cfg, data, ctx)

    # 4. model (GPT-2 family or a local HF model); the criterion compares position t with token t+1
    model = build_model(dict(cfg.model), vocab_size=vocab_size)
    flops = model.flops_per_token(cfg.SEQ_LEN) if hasattr(model, "flops_per_token") else None

    # 5. initialize: ZeRO sharding, offload, precision, optimizer, LR schedule
    engine, train_dl, valid_dl, lr_scheduler = zerogpt.initialize(
        model, dict(cfg.optimizer), criterion=GPTLMLoss(shift=False), train_dataloader=train_dl,
        eval_dataloader=valid_dl, config=cfg, ctx=ctx)
    accum = engine.gradient_accumulation
    if lr_scheduler is None and "lr_scheduler" in cfg:
        total_steps = train.max_steps or (cfg.NUM_EPOCHS or 1) * len(train_dl) // accum
        lr_scheduler = build_lr_scheduler(engine.optimizer, lr_scheduler_config(cfg), total_steps)
    ctx.logger.info(f"tokens/step: {cfg.BATCH_SIZE} seqs x {cfg.SEQ_LEN} tokens x {accum} accumulation x "
                    f"{ctx.world_size} ranks = {cfg.BATCH_SIZE * cfg.SEQ_LEN * accum * ctx.world_size:,}")

    # 6. train: the built-in hooks, then the config's own
    hooks = [LossHook(), ThroughputHook(flops), MemoryHook(train.log_interval), NaNGuardHook(),
             LogMetricByStepHook(out, train.log_interval),
             TensorboardHook(os.path.join(out, "tensorboard"), train.log_interval),
             EvalHook(train.eval_interval, train.eval_iters, at_start=True),
             SaveCheckpointHook(out, train.save_interval, train.keep_last), PlotHook(out)]
    if lr_scheduler is not None:
        hooks.append(LRSchedulerHook(lr_scheduler))
    if sys.stderr.isatty():
        hooks.append(ProgressBarHook())
    trainer = Trainer(engine, hooks=hooks + list(cfg.hooks), logger=ctx.logger)
    if resume:
        ckpt = latest_checkpoint(out) if resume == "auto" else resume
        if ckpt is None:
            ctx.logger.info(f"--resume auto: no checkpoint in {out}/checkpoints yet, starting at step 0")
        else:
            trainer.load_state_dict(engine.load_checkpoint(ckpt))
            ctx.logger.info(f"resumed from {ckpt} at step {trainer.state.step}")
    state = trainer.fit(train_dl, epochs=cfg.NUM_EPOCHS, max_steps=train.max_steps, eval_dataloader=valid_dl)
    engine.close()  # hooks off, offload files removed, the shared-memory transport and its thread closed

    ctx.logger.info(f"done: {state.step} steps, {state.tokens_seen:,} tokens"
                    + (f", valid loss {state.eval_results['loss']:.4f}" if state.eval_results else "")
                    + f"\n  metrics:     {out}/metrics.jsonl\n  plot:        {out}/loss.png"
                    + f"\n  checkpoint:  {latest_checkpoint(out)}\n  tensorboard: tensorboard --logdir {out}/tensorboard")


if __name__ == "__main__":
    sys.exit(main())
