# Llama-3.1-8B (8.03B) continued on whatever GPU, host RAM and world it finds: plan="auto" (zerogpt/planner/) chooses
# the ZeRO stage, optimizer and parameter offload, the moments' dtype, micro-batch x accumulation, checkpointing, the
# chunked loss, bucket size, prefetch and device_budget, tries the fastest predicted few for 2 steps, keeps the
# fastest measured and writes its table to runs/llama3_8b_auto/plan.txt. No memory key is set here.
#   python train_gpt.py --config configs/llama3_8b_auto.py
#   python -m zerogpt_tools.estimate --model llama3_8b --seq-len 8192 --plan auto --gpu-mem 80GiB --host-mem 128GiB
# model.pretrained is a placeholder: your local save_pretrained copy of meta-llama/Llama-3.1-8B (nothing is
# downloaded); data: text tokenized with its tokenizer. Disk offload is considered once a path is given:
# --set zero.offload_optimizer.path=/nvme/dir. Hand-tuned reference: configs/llama3_8b_zero3_offload.py.
# Tokens/step: 8 x 8192 = 65,536 over all ranks. Not yet measured on a GPU.
from model_zoo import llama3_8b
from zerogpt.optim import HybridAdam

plan = "auto"
TOKENS_PER_STEP = 8 * 8192
SEQ_LEN = 8192                 # Llama 3.1's pretraining context
precision = "bf16"
clip_grad_norm = 1.0

model = dict(type=llama3_8b, pretrained="checkpoints/Meta-Llama-3.1-8B")
optimizer = dict(type=HybridAdam, lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1)   # continued: a small lr
lr_scheduler = dict(type="cosine", warmup_steps=100, min_lr=2e-6)

data = dict(path="data/llama3/corpus_text_document", tokenizer="checkpoints/Meta-Llama-3.1-8B")
train = dict(max_steps=2000, log_interval=1, eval_interval=200, eval_iters=10, save_interval=200,
             keep_last=2, output_dir="runs/llama3_8b_auto")
