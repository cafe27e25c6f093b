"""Pretrain a GPT from a config file: config -> launch -> data -> model -> initialize -> Trainer.fit.

The CPU demo (2 ranks; tokenizes the bundled sample corpus on its first run, then trains):
    zerogpt run --nproc-per-node 2 train_gpt.py --config configs/demo_cpu.py
One process, CPU or one GPU:
    python train_gpt.py --config configs/demo_cpu.py --set train.max_steps=50
8 GPUs, overriding keys, continuing from the newest checkpoint if there is one:
    zerogpt run --nproc-per-node 8 train_gpt.py --config configs/gpt2_small_zero2.py \\
        --set zero.stage=3 --set BATCH_SIZE=8 --resume auto
`zerogpt run` is torchrun (the same flags, multi-node included) with a quiet console (zerogpt/launcher.py);
`torchrun --standalone --nproc_per_node 2 train_gpt.py ...` runs the same.

A run writes <train.output_dir>/: config.py (resolved), metrics.jsonl, tensorboard/, checkpoints/step_<N>/,
checkpoints/latest, loss.png (DESIGN §5). A directory holding another run needs --resume auto or --overwrite.
A mistake found before training (config, data, paths, vocabulary: zerogpt/preflight.py) is one line from
rank 0; a crash on any rank keeps its traceback and ends every rank, never a hang (zerogpt/errors.py).
"""
import argparse
import contextlib
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import zerogpt
from zerogpt import preflight
from zerogpt.atomic_write import write_text_atomic
from data_pipeline.cli_args import ArgumentParser
from zerogpt.cli import HelpFormatter
from zerogpt.config import data_config, lr_scheduler_config, parallel_config, train_config
from zerogpt.errors import USER_ERRORS, env_rank, report_crash, report_user_error
from zerogpt.logging import rank_logger, slow_phase
from zerogpt.optim.lr_scheduler import build_lr_scheduler
from zerogpt.parallel.pipeline import Pipeline
from zerogpt.parallel.plan import parallelize
from zerogpt.preflight import is_jsonl
from zerogpt.preflight_memory import check_memory
from zerogpt.trainer import (EvalHook, LogMetricByStepHook, MemoryHook, NaNGuardHook, PlotHook, ProgressBarHook,
                             SaveCheckpointHook, TensorboardHook, ThroughputHook, Trainer, epoch_steps,
                             latest_checkpoint)
from zerogpt.trainer.hooks.nan_guard import NonFiniteLossError
from zerogpt.trainer.hooks.wandb import WandbHook, check_installed as check_wandb_installed
from model_zoo import GPTLMLoss, build_model, builds_on_meta
import data_pipeline

# A data.path named stdlib_docs (configs/demo_cpu.py: .cache/demo/stdlib_docs) is the bundled sample corpus:
# when missing, it and its tokenizer are built from this JSONL with the pipeline's own stages.
SAMPLE = "stdlib_docs"
SAMPLE_CORPUS = os.path.join(os.path.dirname(data_pipeline.__file__), "assets", "sample", f"{SAMPLE}.jsonl")
SAMPLE_VOCAB = 2048


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, help="Python config file, e.g. configs/demo_cpu.py")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, repeatable: --set zero.stage=2 --set train.max_steps=100")
    p.add_argument("--resume", default=None, metavar="auto|CKPT_DIR",
                   help="'auto': continue from <output_dir>/checkpoints/latest if it exists (else start fresh); "
                        "or a checkpoint directory such as runs/x/checkpoints/step_1000")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a train.output_dir that holds another run: delete its metrics, plot, "
                        "checkpoints, tensorboard events and config.py first")
    p.add_argument("--plan", choices=("auto", "manual"), default=None,
                   help="'auto': choose stage, offload, micro-batch x accumulation, checkpointing and the loss for "
                        "this machine (the config's plan key; the keys the config sets stay fixed; docs/configs.md)")
    p.add_argument("--from_torch", action="store_true",
                   help="accepted for the Colossal-AI tutorial's command line; torchrun's environment is the only "
                        "launch mode, so it changes nothing")
    return p


def is_sample(data) -> bool:
    return data.path is not None and os.path.basename(data.path) == SAMPLE and data.tokenizer is not None


def prepare_sample(data, ctx) -> None:
    """First use of the sample corpus: rank 0 trains its tokenizer and tokenizes it; the other ranks wait."""
    from data_pipeline.__main__ import main as pipeline
    if ctx.is_main and not os.path.exists(data.path + ".idx"):
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
    """Train and validation dataloaders and the vocab size. Each data-parallel rank reads its slice of every
    global batch; the T x P ranks that hold one copy of the model between them read the same slice."""
    if data.mock:
        vocab_size = data.vocab_size or 50257
        datasets = [RandomTokens(n, cfg.SEQ_LEN, vocab_size, data.seed + i) for i, n in enumerate((1 << 24, 4096))]
    else:
        # a JSONL file is tokenized once into a cached .bin/.idx (the tutorial's WebtextDataset), a prefix is read as is
        kind, source = ((data_pipeline.WebtextDataset, dict(tokenizer=data.tokenizer)) if is_jsonl(data.path)
                        else (data_pipeline.GPTDataset, {}))
        datasets = [kind(data.path, cfg.SEQ_LEN, split=split, splits=data.split, seed=data.seed,
                         vocab_size=data.vocab_size, **source) for split in ("train", "valid")]
        data.tokenizer = getattr(datasets[0], "tokenizer_dir", data.tokenizer)
        # The vocabulary the data was tokenized with (tokenize records it), so the model's embedding fits it.
        vocab_size = data.vocab_size or datasets[0].meta_file.get("vocab_size") or \
            len(data_pipeline.load_tokenizer(data.tokenizer))
    loaders = []
    for ds, shuffle in zip(datasets, (not data.mock, False)):
        sampler = data_pipeline.DistributedBatchSampler(ds, cfg.BATCH_SIZE, ctx.dp_rank, ctx.dp_size,
                                                        shuffle=shuffle, seed=data.seed)
        loaders.append(torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=data.num_workers,
                                                   pin_memory=ctx.device.type == "cuda"))
    return loaders[0], loaders[1], vocab_size


@record
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # 1. config and preflight: a typo, a bad value or a missing file fails here, before any process group exists
    #    and before anything is written; then rank 0 locks the output directory for the whole run (one run per
    #    directory: a second one started beside it is refused, naming the first's process)
    lock = None
    try:
        plan = [f"plan={args.plan}"] if args.plan else []
        cfg = zerogpt.Config.from_file(args.config).apply_overrides(args.set + plan)
        train, data = train_config(cfg), data_config(cfg)
        if data.seed is None:
            data.seed = train.seed
        from_env = preflight.data_from_env(data)
        preflight.check_data(data, skip=is_sample(data))
        preflight.check_schedule(train, lr_scheduler_config(cfg) if "lr_scheduler" in cfg else None)
        if train.wandb is not None:
            check_wandb_installed(train.wandb.mode)
        preflight.check_optimizer(cfg)
        with slow_phase(rank_logger(), "preflight: the model's shape on the meta device, its layout and memory"):
            dims = preflight.check_parallel(cfg, preflight.env_world_size(), lambda: model_on_meta(cfg, data))
            # the model state must fit this host's RAM (and the offload disk): refused now, not killed mid-build
            if cfg.plan != "auto":  # plan="auto" chooses what fits, with the same arithmetic, once launched
                check_memory(cfg, preflight.env_world_size(), lambda: model_on_meta(cfg, data))
        preflight.check_resume(args.resume)
        preflight.check_output_dir(train.output_dir)   # creates it: the first write
        lock = preflight.lock_run_dir(train.output_dir) if env_rank() == 0 else None
        preflight.check_fresh_run(train.output_dir, args.resume, args.overwrite)
    except USER_ERRORS as e:
        if lock is not None:
            lock.release()
        return report_user_error(e, env_rank(), from_config=True)
    try:
        return launch_and_train(args, cfg, train, data, dims, from_env)
    finally:
        if lock is not None:
            lock.release()


def launch_and_train(args, cfg, train, data, dims, from_env) -> int:
    """Launch, set up and train; the exit code (130 when a signal stopped the run)."""
    # 2. launch: process group, device, CPU threads, seeds, rank-aware logger; with tensor or pipeline parallelism
    #    the (pp, dp, tp) mesh: ZeRO and the data split over "dp"
    ctx = zerogpt.launch_from_torch(cfg, dims=dims)
    ctx.logger.info(dims.describe())
    if from_env:
        ctx.logger.info(f"data.path is not set: using DATA={data.path} from the environment")
    if args.from_torch:
        ctx.logger.info("--from_torch: launching from torchrun's environment, the only launch mode (flag not needed)")
    if args.overwrite and ctx.is_main:
        removed = preflight.clear_run(train.output_dir)
        ctx.logger.info(f"--overwrite: deleted {', '.join(removed) or 'nothing'} in {train.output_dir}")
    trainer = None
    try:
        if cfg.plan == "auto":  # the memory keys chosen for this machine; initialize builds them as if hand-set
            from zerogpt.planner.run import plan_for_run
            cfg = plan_for_run(cfg, ctx, lambda c: model_on_meta(c, data), lambda: GPTLMLoss(shift=False),
                               resume=bool(args.resume), log=ctx.logger.info)
        trainer, train_dl, valid_dl = setup(cfg, train, data, ctx, dims, args.resume)
        if trainer is not None:
            return fit(trainer, cfg, train, train_dl, valid_dl, ctx)
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one during it: out at once, nothing saved
        if ctx.is_main:
            ckpt = latest_checkpoint(train.output_dir)
            print("interrupted: stopped at once, no checkpoint saved; "
                  + (f"{ckpt} is the newest, continue with --resume auto" if ckpt else "no checkpoint yet"),
                  file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # before training, a mistake (data, vocabulary, checkpoint) is one line; then, a crash
        # the NaN guard's stop is a diagnosis with its advice, one line like a mistake, not a crash
        user_error = (trainer is None and isinstance(e, USER_ERRORS)) or isinstance(e, NonFiniteLossError)
        return report_user_error(e, ctx.global_rank) if user_error else report_crash(e, ctx.global_rank)
    finally:
        ctx.destroy()
    return 0


def model_on_meta(cfg, data):
    """The config's model without its weights (meta device): its shape, for the parallel layout's checks."""
    model_cfg = {k: v for k, v in dict(cfg.model).items() if k != "pretrained"}  # same shape, nothing read
    with torch.device("meta"):
        return build_model(model_cfg, vocab_size=preflight.known_vocab_size(data))


def setup(cfg, train, data, ctx, dims, resume):
    """Data, model, engine, hooks and the resumed state: (trainer, train_dl, valid_dl), or Nones when done."""
    out = train.output_dir
    if ctx.is_main:
        with open(os.path.join(out, "config.py"), "w") as f:
            f.write(cfg.to_python())

    # 3. data: each data-parallel rank reads its slice of every global batch
    if is_sample(data):
        prepare_sample(data, ctx)
    train_dl, valid_dl, vocab_size = build_data(cfg, data, ctx)

    # 4. model (GPT-2 family or a local HF model); the criterion compares position t with token t+1. A fresh
    #    model_zoo GPT is built on the meta device (no storage, no init): initialize fills each rank's shards
    #    from GPT.init_param_range, so no rank ever holds the whole model (DESIGN §7); with tensor or pipeline
    #    parallelism, its own part of it only (DESIGN §11).
    model_cfg = dict(cfg.model)
    with torch.device("meta") if builds_on_meta(model_cfg) else contextlib.nullcontext():
        model = build_model(model_cfg, vocab_size=vocab_size, log=ctx.logger.info)  # an HF dir: the path taken
    check_run_vocab(train_dl.dataset, data, model)
    flops = model.flops_per_token(cfg.SEQ_LEN) if hasattr(model, "flops_per_token") else None
    if ctx.mesh is not None:   # this rank's part of it, and what the engine must know of the plans
        model = parallelize(model, ctx.mesh, parallel_config(cfg).tensor.sequence_parallel)

    # 5. initialize: ZeRO sharding (over "dp"), offload, precision, optimizer; the pipeline schedule; the LR schedule
    with slow_phase(ctx.logger, "initialize: building the engine (optimizer, chunks, this rank's shards filled "
                                "from their init or the model's files)"):
        engine = zerogpt.initialize(model, dict(cfg.optimizer), GPTLMLoss(shift=False), config=cfg, ctx=ctx)
    if ctx.is_main:  # every build decision, one per line (the engine line above is its summary)
        write_text_atomic(os.path.join(out, "engine_plan.txt"), engine.plan.describe() + "\n")
    pipeline = Pipeline(engine) if dims.pp > 1 else None
    accum = engine.gradient_accumulation
    lr_scheduler = None
    if "lr_scheduler" in cfg:
        total_steps = last_step(cfg, train, len(train_dl), accum)
        lr_scheduler = build_lr_scheduler(engine.optimizer, lr_scheduler_config(cfg), total_steps)
    ctx.logger.info(f"tokens/step: {cfg.BATCH_SIZE} seqs x {cfg.SEQ_LEN} tokens x {accum} accumulation x "
                    f"{dims.dp} data-parallel ranks = {cfg.BATCH_SIZE * cfg.SEQ_LEN * accum * dims.dp:,}")

    # 6. train: the built-in hooks in the order they run (loggers after the numbers they log, checkpoint last
    #    but the plot), then the config's own
    hooks = [ThroughputHook(flops), MemoryHook(train.log_interval),
             LogMetricByStepHook(out, train.log_interval),
             TensorboardHook(os.path.join(out, "tensorboard"), train.log_interval)]
    if train.wandb is not None and train.wandb.mode != "disabled":  # the same numbers and the config in W&B
        hooks.append(WandbHook(out, train.log_interval, config=cfg.to_dict(), **vars(train.wandb)))
    hooks.append(NaNGuardHook())
    if sys.stderr.isatty():
        hooks.append(ProgressBarHook())
    hooks += [EvalHook(train.eval_interval, train.eval_iters, at_start=True),
              SaveCheckpointHook(out, train.save_interval, train.keep_last, save_on_interrupt=train.save_on_interrupt),
              PlotHook(out)]
    # Ctrl-C / SIGTERM: every rank stops after the same step, the checkpoint hook saves it, fit() returns
    trainer = Trainer(engine, hooks=hooks + list(cfg.hooks), lr_scheduler=lr_scheduler, logger=ctx.logger,
                      pipeline=pipeline, stop_on_signal=True)
    if resume:
        ckpt = latest_checkpoint(out) if resume == "auto" else resume
        if ckpt is None:
            ctx.logger.info(f"--resume auto: no checkpoint in {out}/checkpoints yet, starting at step 0")
        else:
            with slow_phase(ctx.logger, f"resume: reading {ckpt} into this rank's shards"):
                trainer.load_state_dict(engine.load_checkpoint(ckpt))
            ctx.logger.info(f"resumed from {ckpt} at step {trainer.state.step}")
            end = last_step(cfg, train, len(train_dl), accum)
            if trainer.state.step >= end:
                ctx.logger.info(preflight.finished_message(ckpt, trainer.state.step, end, lr_scheduler,
                                                           fit_epochs(cfg, train)))
                engine.close()
                return None, None, None
    return trainer, train_dl, valid_dl


def check_run_vocab(dataset, data, model) -> None:
    """The train split's recorded vocabulary and largest id, data.tokenizer and the model agree (preflight).

    The model's side is the rows of its input embedding where it has one (HF models, the Llama family; the
    shape is there on the meta device too), so a tokenizer whose added tokens run past the embedding is refused.
    model_zoo's models pad those rows for speed and slice logits to config.vocab_size, so where that is smaller
    it is the bound (GPT has no get_input_embeddings: config.vocab_size, as before). The tokenizer's side is
    len(tokenizer), added tokens included, not tokenizer.vocab_size.
    """
    if data.mock:
        return
    prefix, recorded = dataset.prefix, dataset.meta_file.get("vocab_size")
    tokenizer = None
    if data.tokenizer:
        tok = data_pipeline.load_tokenizer(data.tokenizer)
        added = len(tok) - tok.vocab_size
        tokenizer = (len(tok), f"data.tokenizer={data.tokenizer}"
                     + (f": {tok.vocab_size:,} + {added:,} added tokens" if added > 0 else ""))
    try:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError, KeyError):  # an HF base model without one; a stage without it
        embedding = None
    rows = getattr(embedding, "num_embeddings", None)
    real = getattr(getattr(model, "config", None), "vocab_size", None)
    if rows is not None and (real is None or rows <= real):
        model_vocab = (rows, "rows of the model's input embedding")
    else:
        model_vocab = (real, "the model's vocab_size") if real else None
    preflight.check_vocab(dataset=(recorded, f"{prefix}.stats.json") if recorded else None,
                          max_id=(dataset.max_token_id, f"largest id in the train split of {prefix}.bin"),
                          tokenizer=tokenizer, model=model_vocab,
                          data_key=(data.vocab_size, "data.vocab_size") if data.vocab_size else None)


def fit_epochs(cfg, train) -> int | None:
    """The epochs Trainer.fit runs: None when train.max_steps decides the run's length, else NUM_EPOCHS (one by
    default); the LR schedule's length and the resume check count the same (last_step)."""
    return None if train.max_steps else cfg.NUM_EPOCHS or 1


def last_step(cfg, train, micro_batches: int, accum: int) -> int:
    """The step the run ends at: train.max_steps, else the optimizer steps fit_epochs() passes make."""
    return train.max_steps or epoch_steps(fit_epochs(cfg, train), micro_batches, accum)


def fit(trainer, cfg, train, train_dl, valid_dl, ctx) -> int:
    out = train.output_dir
    state = trainer.fit(train_dl, epochs=fit_epochs(cfg, train), max_steps=train.max_steps, eval_dataloader=valid_dl)
    trainer.engine.close()  # hooks off, offload files removed, the shared-memory transport and its thread closed
    if state.interrupted:
        ckpt = latest_checkpoint(out)
        ctx.logger.info(f"interrupted ({state.interrupted}) at step {state.step}: "
                        + (f"checkpoint {ckpt} kept, continue with --resume auto" if ckpt else
                           "no checkpoint yet, a new run starts at step 0"))
        return 130

    ctx.logger.info(f"done: {state.step} steps, {state.tokens_seen:,} tokens"
                    + (f", valid loss {state.eval_results['loss']:.4f}" if state.eval_results else "")
                    + f"\n  metrics:     {out}/metrics.jsonl\n  plot:        {out}/loss.png"
                    + f"\n  checkpoint:  {latest_checkpoint(out)}\n  tensorboard: tensorboard --logdir {out}/tensorboard"
                    + f"\n  continue:    add --resume auto --set train.max_steps={2 * state.step}"
                    + "\n  start over:  add --overwrite, or --set train.output_dir=NEW_DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
