"""Issue 56 end to end: the engine with real agents (master scheduling and slots, the agents' graphs) serves three
PEFT adapters of different ranks and targets mixed with base requests, on fewer slots than adapters (slots
reloaded while serving), with chunked prefill and prefix-cache hits, at TP 1 and 2: every request's greedy ids are
PEFT's own (an unmerged ``PeftModel`` per adapter), the base requests the base model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import hf_greedy
from tests.hf_tokenizer_fixture import build_chatml_tokenizer
from tests.test_lora_graphs import ADAPTERS, NAMES

peft = pytest.importorskip("peft")

VOCAB = 600  # the ChatML test tokenizer's
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
STEPS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A random base model with a tokenizer, its three adapters' directories, and the reference model of each
    name (None: the base)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_random_model(tmp_path_factory.mktemp("lora-served"), CONFIG, seed=8, std=0.15)
    chatml = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"), VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_text((chatml / name).read_text())
    dirs, models = {}, {None: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for seed, name in enumerate(NAMES):
        torch.manual_seed(10 + seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
        with torch.no_grad():
            for module_name, param in model.named_parameters():
                if "lora_B" in module_name:
                    param.mul_(0.5)
        dirs[name] = tmp_path_factory.mktemp("adapter") / name
        model.save_pretrained(dirs[name])
        models[name] = model.eval()
    return model_dir, dirs, models


@pytest.mark.parametrize("ranks", [1, 2])
def test_adapters_and_base_requests_are_peft_s_through_the_engine(served, ranks):
    model_dir, dirs, models = served
    cfg = ServingConfig.from_dict({
        "model_config": {"model_path": str(model_dir), "seq_length": [32], "prefill_batch_size": [4],
                         "decode_batch_size": [8]},
        "pa_config": {"num_blocks": 96, "block_size": 8, "decode_seq_length": 64},
        "scheduler": {"enable_chunked_prefill": True, "max_num_batched_tokens": 16, "enable_prefix_caching": True},
        "serving_config": {"num_agents": ranks, "compile_cache": False},
        "lora": {"enable": True, "max_loras": 2, "max_lora_rank": 8,
                 "modules": {name: str(path) for name, path in dirs.items()}}})
    rng = np.random.default_rng(ranks)
    asks = [rng.integers(3, VOCAB, n).tolist() for n in (21, 9)]  # 21 tokens: two chunks of 16 and 5
    jobs = [(ids, name) for name in (None, *NAMES) for ids in asks]
    want = {(tuple(ids), name): hf_greedy(models[name], ids, STEPS)[0] for ids, name in jobs}
    assert len({tuple(w) for w in want.values()}) == len(want)  # every adapter changes every answer
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    with Engine(cfg) as engine:
        engine.start(progress=None)
        for _ in range(2):  # the second round starts on the first's cached prompt blocks, per adapter
            streams = [engine.submit(ids, params, adapter=name) for ids, name in jobs]
            for (ids, name), stream in zip(jobs, streams):
                assert stream.result(timeout=600).token_ids == want[(tuple(ids), name)], (name, len(ids))
        stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["kv_blocks_used"] == 0
