"""plan="auto": the planner that chooses a run's memory keys for the machine it finds (issue 47).

plan.py      Plan, Workload, Machine: plain data (no torch)
speed.py     the written-down speed model and its calibration by measured steps (no torch)
search.py    every plan reaching the tokens per step, memory from memory_model.estimate, the fastest that fits;
             nothing fitting as one line with the smallest change that fits (no torch)
explain.py   the table: chosen plan, runners-up, predicted and measured, why each lost (no torch)
config_plan.py  a config's Workload and fixed keys; a Plan written into a config (no torch)
machine.py   the machine's capacities, fingerprint, CPU rate, the plan cache
auto.py      config -> search -> trials -> chosen config, table, cache (the trial is passed in)
trial.py     trial steps: a plan built and run for real, measured, discarded (torch)
run.py       plan="auto" inside a launched run: every rank the same plan (torch.distributed)
"""
from zerogpt.planner.plan import CONFIG_KEYS, Machine, Plan, PlanError, Workload

__all__ = ["Plan", "Workload", "Machine", "PlanError", "CONFIG_KEYS"]
