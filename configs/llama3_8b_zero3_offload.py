# Llama-3.1-8B (8.03B) continued on ONE 80 GB GPU with 128 GB of host RAM: ZeRO-3, the bf16 params, grads, fp32
# master and Adam state in CPU RAM, activation checkpointing per layer, the loss a chunk at a time (128k vocab).
#   python train_gpt.py --config configs/llama3_8b_zero3_offload.py
# model.pretrained is a placeholder: point it at your local save_pretrained copy of meta-llama/Llama-3.1-8B (nothing is
# downloaded; the weights stream from its safetensors into the shards), and data at text tokenized with its tokenizer.
# Memory (python -m zerogpt_tools.estimate --model llama3_8b --offload cpu --offload-param cpu --state-dtype bf16
#   --seq-len 8192 --batch 8 --checkpoint --chunked-loss --bucket-mb 64 --gpu-mem 80GiB --host-mem 128GiB):
#   host: 2 param + 2 grad + 4 master + 4 Adam moments in bf16 = 12 B x 8.03B = 89.75 GiB (70%); with fp32
#   moments 16 B = 119.66 GiB, 93% of 128 GiB before the OS, the process and the data: hence state_dtype="bf16".
#   GPU: 30.57 GiB activations (28.26 in the layers: 0.5 GiB of input each + 12.26 GiB for the one recomputed;
#   2.31 GiB final norm + loss chunk) + 3.04 GiB chunk buffers + 1 GiB CUDA = 34.61 GiB (43%).
# Tokens/step: 8 seqs x 8192 x 1 GPU = 65,536 in one micro-batch, as for GPT-2 XL: the host step (CPU Adam over
# 8B params) costs the same however the tokens are split. Accumulating sums grads in fp32 on the host: 104.70 GiB.
# Not yet measured on a GPU.
from zerogpt.optim import HybridAdam
from model_zoo import llama3_8b
from zerogpt.zero import BucketTensorShardStrategy

BATCH_SIZE = 8
GRADIENT_ACCUMULATION = 1
SEQ_LEN = 8192                 # Llama 3.1's pretraining context
precision = "bf16"
clip_grad_norm = 1.0

zero = dict(stage=3, shard_strategy=BucketTensorShardStrategy(bucket_mb=64), prefetch=2,
            offload_param=dict(device="cpu"), offload_optimizer=dict(device="cpu", state_dtype="bf16"))
model = dict(type=llama3_8b, pretrained="checkpoints/Meta-Llama-3.1-8B", checkpoint=True, chunked_loss=True)
optimizer = dict(type=HybridAdam, lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)   # continued: a small lr
lr_scheduler = dict(type="cosine", warmup_steps=100, min_lr=2e-6)

data = dict(path="data/llama3/corpus_text_document", tokenizer="checkpoints/Meta-Llama-3.1-8B")
train = dict(max_steps=2000, log_interval=1, eval_interval=200, eval_iters=10, save_interval=200,
             keep_last=2, output_dir="runs/llama3_8b_zero3_offload")
