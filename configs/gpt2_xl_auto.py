# GPT-2 XL (1.56B) on whatever GPU, host RAM and world it finds: plan="auto" (zerogpt/planner/) chooses the ZeRO
# stage, optimizer and parameter offload, the moments' dtype, micro-batch x accumulation, checkpointing, the chunked
# loss, bucket size, prefetch and device_budget; it runs 2 trial steps of the fastest predicted few, keeps the
# fastest measured, and writes its table to runs/gpt2_xl_auto/plan.txt. No memory key is set here: one set is kept.
#   python train_gpt.py --config configs/gpt2_xl_auto.py
#   python -m zerogpt_tools.estimate --model gpt2_xl --plan auto --gpu-mem 24GiB --host-mem 64GiB   (no training)
# Disk offload is considered once a path is given: --set zero.offload_optimizer.path=/nvme/dir
# The hand-tuned reference for one 80 GB GPU and a 128 GB host: configs/gpt2_xl_zero3_offload.py.
# Tokens/step: 64 x 1024 = 65,536 over all ranks, however the planner splits them. Not yet measured on a GPU.
from model_zoo.gpt import gpt2_xl
from zerogpt.optim import HybridAdam

plan = "auto"
TOKENS_PER_STEP = 64 * 1024
SEQ_LEN = 1024
precision = "bf16"
clip_grad_norm = 1.0

model = dict(type=gpt2_xl)
optimizer = dict(type=HybridAdam, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1)
lr_scheduler = dict(type="cosine", warmup_steps=200, min_lr=2e-5)

data = dict(path="data/webtext/webtext_text_document", tokenizer="data/webtext/tokenizer")
train = dict(max_steps=5000, log_interval=5, eval_interval=250, eval_iters=10, save_interval=250,
             keep_last=2, output_dir="runs/gpt2_xl_auto")
