"""zerogpt: ZeRO-style GPT pretraining when memory is the limit.

Install:  pip install torch==2.13.0 && pip install -e '.[dev]'
(torch is pinned first so pip does not pull a multi-GB CUDA build on CPU machines;
deepspeed is built without build isolation against that torch, see .ci/run.)
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.3",
    "numpy",
    "transformers>=4.40",
    "datasets",
    "tokenizers",
    # a model's sentencepiece tokenizer.model (Llama-2, Mistral) becomes a fast tokenizer through these
    "sentencepiece",
    "protobuf",
    "safetensors",
    "ftfy",
    "langdetect",
    "datasketch",
    "tldextract",
    "aiohttp",
    "trafilatura",
    "lxml_html_clean",
    "ninja",
    "tensorboard",
    "tqdm",
    "rich",
    "matplotlib",
    "psutil",
    # the pipeline's CPU stages run as sharded, resumable tasks on datatrove's executors (bench/README.md)
    "datatrove>=0.10",
    "fsspec",
    # users' own data in cleanup (data_pipeline/readers.py): datatrove's JsonlReader needs orjson, its
    # ParquetReader pyarrow; WARC/WET files are read with warcio
    "orjson",
    "pyarrow",
    "warcio",
]

setup(
    name="zerogpt",
    version="0.1.0",
    description="ZeRO-sharded GPT pretraining with CPU/disk offload, config files and a webtext pipeline",
    packages=find_packages(include=["zerogpt", "zerogpt.*", "zerogpt_tools", "model_zoo", "model_zoo.*",
                                    "data_pipeline", "data_pipeline.*"]),
    package_data={"data_pipeline": ["assets/*", "assets/**/*"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # the pipeline's tests run a local Ray; the W&B hook's test runs wandb offline; tests/test_fp8.py converts;
        # tests/zerogpt_tools/test_megatron_core.py reads and writes checkpoints with Megatron-Core's own model and files
        "dev": ["pytest", "pytest-timeout", "ray[data]>=2.40", "wandb", "torchao", "megatron-core==0.16.1"],
        "ray": ["ray[data]>=2.40"],  # `python -m data_pipeline all --executor ray`
        # accelerate: transformers' HfDeepSpeedConfig, DeepSpeed's way into from_pretrained (bench/load_memory.py)
        "deepspeed": ["deepspeed", "accelerate>=1.1.0"],
        "wandb": ["wandb"],  # train.wandb = dict(project=...): log to Weights & Biases
        "fp8": ["torchao"],  # precision = "fp8": torchao's float8 training (zerogpt/fp8.py)
    },
    entry_points={
        "console_scripts": [
            "zerogpt=zerogpt.launcher:main",  # zerogpt run [torchrun flags] train_gpt.py ...; zerogpt build-ops
            "zerogpt-estimate=zerogpt_tools.estimate:main",
            "zerogpt-export=zerogpt_tools.export:main",
            "zerogpt-generate=zerogpt_tools.generate:main",
            "zerogpt-extend-vocab=zerogpt_tools.extend_vocab:main",
            "zerogpt-import-megatron=zerogpt_tools.import_megatron:main",
            "zerogpt-pipeline=data_pipeline.__main__:main",
        ]
    },
)
