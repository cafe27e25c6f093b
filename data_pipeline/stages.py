"""The stages of the pipeline: each one's module and one-line help, in the order of the chain, and
which of them can also run as sharded tasks on an executor.

The CLI (`__main__`), `all` (run_all.py) and the task runner (dist_stages.py) all load a stage
through `load_stage`; this module imports none of them, nor any stage until one is asked for, so
a missing or broken optional stage never breaks the others.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# stage name -> (module, one-line help). Order is the order of the chain.
STAGES: dict[str, tuple[str, str]] = {
    "blacklist": ("data_pipeline.blacklist", "filter a URL list by domain, extension, scheme, duplicates"),
    "download": ("data_pipeline.download", "fetch URLs (async, resumable) and extract main text"),
    "cleanup": ("data_pipeline.cleanup", "fix text, filter by language, length and quality"),
    "find-duplicates": ("data_pipeline.find_duplicates", "MinHash LSH candidate pairs verified by Jaccard"),
    "group-duplicates": ("data_pipeline.group_duplicates", "union-find duplicate pairs into groups"),
    "remove-duplicates": ("data_pipeline.remove_duplicates", "drop all but the keeper of each group"),
    "shuffle": ("data_pipeline.shuffle", "seeded shuffle, external for files larger than RAM"),
    "train-tokenizer": ("data_pipeline.train_tokenizer", "train a byte-level BPE tokenizer"),
    "tokenize": ("data_pipeline.tokenize_stage", "tokenize JSONL into Megatron .bin/.idx"),
    "merge-tokenizers": ("data_pipeline.merge_tokenizers", "merge tokenizer vocabularies"),
    "all": ("data_pipeline.run_all", "run blacklist -> ... -> shuffle [-> tokenize], skipping complete stages"),
}

# Stages that can run as sharded tasks on --executor: the keys of dist_stages.JOBS, named here so
# that building the CLI does not import the task code (datatrove, numpy).
DIST_JOBS = ("blacklist", "cleanup", "find-duplicates", "group-duplicates", "remove-duplicates", "shuffle",
             "tokenize")


def load_stage(name: str) -> ModuleType:
    """Import the module of stage `name`; ValueError naming the stage if it is unavailable."""
    module_name = STAGES[name][0]
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"stage {name!r} is unavailable: cannot import {module_name} ({e})") from e
