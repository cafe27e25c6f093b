"""The slices of bench/gpu_check.py: GPU measurements cut to fit one lent machine's 15 minutes (issues 42, 46).

Each slice is one module with a `run(args, budget, result, save)` that fills its part of the result and saves it
as it goes: verify.py (the CUDA paths: `pytest -m gpu`, the shipped config through train_gpt.py, device syncs per
step), offload.py (zerogpt against DeepSpeed ZeRO-Offload), largest.py (Llama-3.1-8B's shape, everything
offloaded), compute.py (MFU without offload on GPT-2 XL, and the levers toward the goal), llama1b.py and
llama3b.py (the Llama family without offload, beside transformers: compute_llama.py), auto.py (plan="auto" for
GPT-2 XL against the shipped hand-tuned config, issue 47). runner.py owns the processes, the clock and the
installs; record.py owns the result files, which slice is next, how long each is
expected to take, and the goals table of bench/README.md; mfu.py the FLOP count and the figures of a compute table.
"""

SLICES = ("verify", "offload", "largest", "compute", "llama1b", "llama3b", "auto")
"""In the order the issues give them: the order of first measurement, and of ties."""

EXPECTED_S = dict(verify=240.0, offload=300.0, largest=540.0, compute=360.0, llama1b=240.0, llama3b=360.0,
                  auto=300.0)
"""Seconds a slice is expected to take on a GPU before it has a recorded result (then its last result's
elapsed_s counts): estimates from the first H200 runs (verify 190 s, offload 274 s, compute's first 13 rows
213 s) and the rows added since; largest takes whatever budget it is given. auto (not yet run on a GPU): on a
bare machine the installs and the host-Adam op build (27 s in verify's H200 run of 2026-11-28), the shipped config
through train_gpt.py (49 s of wall there, build and 5 steps; 60-70 s at times), then plan="auto": up to 3 trials
of 2 steps, each a GPT-2 XL build (~20-40 s), before its own build and steps (~60 s): ~30 + 70 + 120 + 60 = 280,
rounded up to 300."""
