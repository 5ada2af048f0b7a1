"""llm-serving: a continuous-batching LLM server for MindSpore Llama models."""

from setuptools import find_packages, setup

setup(
    name="llm-serving",
    version="0.1.0",
    description="Continuous-batching LLM serving for MindSpore Llama models (CPU and Ascend)",
    packages=find_packages(include=["llm_serving", "llm_serving.*", "agents", "agents.*", "loadtest",
                                    "loadtest.*"]),
    # the native CPU kernels are compiled from these sources on the serving machine at first start
    package_data={"agents.model": ["kernels/*.cc", "kernels/*.h"], "llm_serving.bench": ["data/*.txt"],
                  # the shipped trained model pair (default_model.weights: trained)
                  "llm_serving.models": ["pydoc/*/*.json", "pydoc/*/*.safetensors", "pydoc/*/*.model"]},
    python_requires=">=3.10",
    install_requires=[
        "mindspore==2.10.0",
        "numpy<2",
        "sentencepiece",
        "tokenizers",  # Hugging Face tokenizer.json (Llama 3, Qwen): the field's library, not our own BPE
        "pyyaml",
        "aiohttp",
        "safetensors",
        "prometheus_client",
        "matplotlib>=3.5",
        "tqdm",
        "jinja2",
        "pydantic>=2",  # the OpenAI request bodies as models (llm_serving.api.body_model), as vLLM's protocol
        "protobuf",  # sentencepiece's model proto: chat templates of tokenizers with legacy false
        # structured output (JSON schema, regex): chosen over outlines-core (~150 ms to compile a small schema,
        # 30-50 us a mask, integer bounds not enforced) and xgrammar (needs torch, transformers and triton):
        # ~1 ms to compile, ~25 us median a mask on a 32k vocabulary (docs/benchmarks.md, bench_structured)
        "llguidance>=1.0",
    ],
    # MindFormers (model_config.backend: mindformers) needs MindSpore 2.7.2, not our pin: it gets its own
    # environment from scripts/mindformers_env.sh rather than an extra here
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",  # scripts/test.sh spreads a whole-suite run over workers
            "torch==2.13.0",
            "transformers",
            # int8 checkpoints written by the format's own compressor and read back by transformers
            # (tests/test_int8_checkpoint.py); it brings only loguru beyond torch and transformers
            "compressed-tensors",
            "openai",
            "peft",  # LoRA adapters made and merged by PEFT itself: the reference (tests/test_lora_adapters.py)
            "jsonschema",  # structured answers checked against their schema by the reference validator
            "ruff==0.17.6",
            "mypy==2.4.1",  # scripts/test.sh type-checks llm_serving ([tool.mypy] in pyproject.toml)
        ],
    },
    entry_points={"console_scripts": ["llm-serving=llm_serving.cli.main:main"]},
)
