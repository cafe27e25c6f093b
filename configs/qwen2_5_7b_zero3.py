# Qwen2.5-7B (7.62B) continued on 8 GPUs: ZeRO-3 with everything on the GPUs (no offload), bf16, activation
# checkpointing per layer, the loss a chunk at a time (152k vocab).
#   zerogpt run --nproc-per-node 8 train_gpt.py --config configs/qwen2_5_7b_zero3.py
# model.pretrained is a placeholder: point it at your local save_pretrained copy of Qwen/Qwen2.5-7B (nothing is
# downloaded; the weights stream from its safetensors into the shards), and data at text tokenized with its tokenizer.
# Memory per GPU (python -m zerogpt_tools.estimate --model qwen2_5_7b --world 8 --seq-len 4096 --batch 8
#   --grad-accum 2 --checkpoint --chunked-loss --bucket-mb 64 --gpu-mem 80GiB): model states 18 B x 7.62B / 8 =
#   15.96 GiB (2 bf16 param + 4 fp32 grad + 4 master + 8 Adam, sharded 8 ways) + 14.24 GiB activations + 3.23 GiB
#   chunk buffers + 1 GiB CUDA = 34.43 GiB (43% of 80 GiB); nothing on the host but the processes.
# Tokens/step: GLOBAL_BATCH_SIZE 128 seqs x 4096 = 524,288 (~0.5M); on 8 GPUs that is 8 seqs x 2 accumulation per
# rank, and the accumulation adapts if the GPU count changes. Not yet measured on a GPU.
from model_zoo import qwen2_5_7b
from zerogpt.zero import BucketTensorShardStrategy

BATCH_SIZE = 8                 # micro-batch per GPU
GLOBAL_BATCH_SIZE = 128        # sequences per optimizer step, all ranks together
SEQ_LEN = 4096
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=64), prefetch=2)
model = dict(type=qwen2_5_7b, pretrained="checkpoints/Qwen2.5-7B", checkpoint=True, chunked_loss=True)
optimizer = dict(type="AdamW", lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)   # continued: a small lr
lr_scheduler = dict(type="cosine", warmup_steps=100, min_lr=2e-6)

data = dict(path="data/qwen2_5/corpus_text_document", tokenizer="checkpoints/Qwen2.5-7B")
train = dict(max_steps=5000, log_interval=10, eval_interval=250, eval_iters=10, save_interval=500,
             keep_last=2, output_dir="runs/qwen2_5_7b_zero3")
