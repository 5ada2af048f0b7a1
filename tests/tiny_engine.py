"""The small real model several engine tests serve (the embedded default model's recipe, shrunk), and the OpenAI
client tests point at a server."""

from __future__ import annotations

import json
from pathlib import Path

import openai

from llm_serving.config.serving_config import ServingConfig

TINY_MODEL = {"weights": "random", "hidden_size": 64, "intermediate_size": 160, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "vocab_size": 1000, "seed": 3}


def tiny_engine_config(data_dir: Path, **sections: dict) -> ServingConfig:
    """Serve ``TINY_MODEL`` (built under ``data_dir``) with small buckets; ``sections`` override per section."""
    d = {"default_model": {"data_dir": str(data_dir), **TINY_MODEL},
         "model_config": {"seq_length": [32], "prefill_batch_size": [4], "decode_batch_size": [4]},
         "pa_config": {"num_blocks": 32, "block_size": 8, "decode_seq_length": 64},
         "serving_config": {"compile_cache": False}}
    for name, values in sections.items():
        d[name] = {**d.get(name, {}), **values}
    return ServingConfig.from_dict(d)


# ``llm-serving serve --set`` values of the small real model that several modules query over HTTP (conftest's
# session-wide ``tiny_server``)
TINY_SERVED = {"default_model.weights": "random", "default_model.hidden_size": 64,
               "default_model.intermediate_size": 128, "default_model.num_layers": 2,
               "model_config.seq_length": [128],
               "model_config.prefill_batch_size": [2], "model_config.decode_batch_size": [4],
               "pa_config.num_blocks": 48, "pa_config.decode_seq_length": 160}


def set_args(values: dict) -> list[str]:
    """``--set key=value`` arguments of ``llm-serving serve`` (values as JSON)."""
    return [a for k, v in values.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
