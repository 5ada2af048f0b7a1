"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, an explicit head_dim wider than hidden_size / heads, tied
embeddings) through one Llama layer with their switches: greedy ids equal to transformers' own Qwen2/Qwen3 models
on the native and portable CPU ops and on the Ascend backend's graphs (CPU stand-ins of its fused kernels), whole
prompts and chunks over cached context; each family's difference shown to matter; every rank's slice of the
biases and norms; the Ascend graphs of every family exported and contract-checked, one rank of two included; a Qwen
directory with a ChatML tokenizer.json served by the engine (at tensor parallelism 2): apply_chat_template's ids,
transformers' greedy ids, its end of turn a stop id."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from agents.weights.sharded import load_shard, shard_shapes
from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan
from llm_serving.tokenization.chat_template import load_chat_template
from llm_serving.tokenization.hf_tokenizer import load_tokenizer
from tests.chunk_driver import ChunkDriver
from tests.hf_tokenizer_fixture import build_chatml_tokenizer
from tests.paged_driver import PagedDriver

BASE = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rope_theta": 1e6}
FAMILIES = {
    "qwen2": LlamaConfig(**BASE, architecture="Qwen2ForCausalLM"),  # head_dim 64
    # head_dim 128: queries 512 wide over a hidden size of 256, as Qwen3-0.6B's 2048 over 1024
    "qwen3": LlamaConfig(**BASE, architecture="Qwen3ForCausalLM", explicit_head_dim=128, tie_word_embeddings=True),
}
PROMPT_LENS = (9, 30, 17)
STEPS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Each family's directory (its config.json as transformers writes the family's) and its greedy ids from
    transformers' own class for it."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, config in FAMILIES.items():
        model_dir = build_random_model(tmp_path_factory.mktemp(name), config, seed=6, std=0.25)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        assert type(hf).__name__ == config.architecture
        refs = [hf_greedy(hf, p, STEPS) for p in prompts()]
        out[name] = (model_dir, LlamaConfig.from_model_dir(model_dir), refs)
    return out


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]  # Qwen prompts carry no BOS


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


RC = RunnerConfig(num_blocks=32, block_size=16, max_model_len=64, prefill_batch_sizes=(2,),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(4,), decode_block_widths=(4,))


def runner_for(model_dir, config: LlamaConfig, ops: str, **rc) -> ModelRunner:
    backend = AscendBackend(ReferenceOps(config.head_dim)) if ops == "ascend" else None
    kernels = {} if ops == "ascend" else {"kernels": ops}
    runner = ModelRunner(config, load_weights(model_dir, config), dataclasses.replace(RC, **kernels, **rc), backend)
    runner.warmup()
    return runner


def test_the_config_reads_each_familys_switches(models):
    qwen2, qwen3 = models["qwen2"][1], models["qwen3"][1]
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.head_dim, qwen2.q_dim) == (True, False, 64, 256)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim, qwen3.q_dim) == (False, True, 128, 512)
    assert qwen3.tie_word_embeddings and qwen3 == dataclasses.replace(FAMILIES["qwen3"], eos_token_ids=(2,))
    weights = load_weights(models["qwen3"][0], qwen3)
    assert weights["layers.0.wo"].shape == (256, 512) and weights["layers.0.w_qkv"].shape == (512 + 2 * 256, 256)
    assert weights["layers.1.q_norm"].shape == (128,) and "layers.0.qkv_bias" not in weights


NEUTRAL = {"qwen2": ("qkv_bias",), "qwen3": ("q_norm", "k_norm")}  # each family's own weights


@pytest.mark.parametrize("family, ops", [("qwen2", "native"), ("qwen3", "native"), ("qwen3", "portable"),
                                         ("qwen3", "ascend")])  # Qwen2's bias is one graph Add on every backend
def test_greedy_ids_are_transformers_own_family_models(models, family, ops):
    """Whole prompts (prefill, then decode) and, on CPU, the same prompts in chunks of 7 over their cached
    context with decodes mixed in (the chunked-prefill and prefix-cache path; the switches sit before the
    attention, so the Ascend stand-ins' own chunked path is tests/test_ascend_chunked.py's). Then the
    counter-check: each of the family's own weights made neutral (zero biases, unit norms) changes the ids, so
    the equality rests on the switch being computed."""
    from agents.model.llama import load_weights_into

    model_dir, config, refs = models[family]
    runner = runner_for(model_dir, config, ops, **({} if ops == "ascend" else {"mixed_steps": True,
                                                                               "max_num_batched_tokens": 32}))
    tokens, _ = PagedDriver(runner, seed=1).generate(prompts(), STEPS)
    assert tokens == refs
    if ops == "ascend":
        return
    chunked, _ = ChunkDriver(runner, seed=2).generate(prompts(), STEPS, chunk=7, starts=[0, 2, 3])
    assert chunked == refs
    for weight in NEUTRAL[family]:
        weights = load_weights(model_dir, config)
        for key in [k for k in weights if k.endswith(weight)]:
            weights[key] = np.zeros_like(weights[key]) if weight == "qkv_bias" else np.ones_like(weights[key])
        load_weights_into(runner.model, weights)
        assert PagedDriver(runner, seed=1).generate(prompts(), STEPS)[0] != refs, weight


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_holds_its_heads_bias_rows_and_every_head_norm(models, family):
    model_dir, config, _ = models[family]
    full = load_weights(model_dir, config)
    for rank in range(2):
        plan = ShardPlan(config, 2, rank)
        got = load_shard(model_dir, config, plan)
        assert {k: v.shape for k, v in got.items()} == shard_shapes(config, plan)
        rows = np.concatenate([np.arange(*r) for r in plan.qkv_rows()])
        np.testing.assert_array_equal(got["layers.1.w_qkv"], full["layers.1.w_qkv"][rows])
        if config.qkv_bias:
            np.testing.assert_array_equal(got["layers.1.qkv_bias"], full["layers.1.qkv_bias"][rows])
        if config.qk_norm:
            np.testing.assert_array_equal(got["layers.1.k_norm"], full["layers.1.k_norm"])
        lo, hi = plan.attention_columns()
        np.testing.assert_array_equal(got["layers.1.wo"], full["layers.1.wo"][:, lo:hi])


@pytest.mark.parametrize("family, tp, rank", [("qwen2", 2, 1), ("qwen3", 1, 0), ("qwen3", 2, 0)])
def test_the_ascend_graphs_of_each_family_export_and_pass_the_contract_check(models, tmp_path, family, tp, rank):
    """On the NPU's fused primitives in float16: the biases an Add after the QKV MatMul, Qwen3's q/k norms two
    more RmsNorm per layer over [tokens, heads, head_dim] before ApplyRotaryPosEmb; every rule of
    agents.tools.contracts holds (one rank of two with its collectives too)."""
    from agents.tools.contracts import check_graph
    from agents.tools.export import export_graphs, export_runner
    from agents.tools.mindir import read_graph
    from agents.weights.sharded import load_rank_weights

    model_dir, config, _ = models[family]
    plan = ShardPlan(config, tp, rank)
    rc = dataclasses.replace(RC, dtype="float16", device_target="Ascend", decode_batch_sizes=(1, 4))
    runner = export_runner(config, rc, load_rank_weights(model_dir, config, plan, np.float16), shard=plan)
    done = export_graphs(runner, tmp_path, [("decode", 4, 4), ("ragged", 2, 48)])
    for _, summary in done:
        graph = read_graph(summary.path)
        assert check_graph(graph, tensor_parallel=tp) == [], summary.path.name
        norms = graph.of("RmsNorm")
        assert len(norms) == config.num_hidden_layers * (4 if config.qk_norm else 2) + 1
        if config.qk_norm:
            assert {n.inputs[0].info.shape[1:] for n in norms} >= {(plan.heads, 128), (plan.kv_heads, 128)}
        heads = {n.inputs[10].value for n in graph.of("PagedAttention") or graph.of("FlashAttentionScore")}
        assert heads == {plan.heads}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


@pytest.mark.parametrize("family, tp", [("qwen2", 1), ("qwen3", 2)])
def test_a_qwen_directory_is_served_by_the_engine_with_its_chat_template(tmp_path, chatml, family, tp):
    """Qwen3 (the family furthest from Llama) at tensor parallelism 2; Qwen2's sharded biases are checked above.
    config.json names <|endoftext|> as eos (as Qwen base models do), tokenizer_config.json <|im_end|>: both
    stop a request. The chat prompt is apply_chat_template's (the default system turn, no BOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = load_tokenizer(chatml)
    end_of_text, end_of_turn = tok.piece_to_id("<|endoftext|>"), tok.piece_to_id("<|im_end|>")
    config = dataclasses.replace(FAMILIES[family], vocab_size=tok.vocab_size, bos_token_id=end_of_text,
                                 eos_token_id=end_of_text)
    model_dir = build_random_model(tmp_path / family, config, seed=4, std=0.3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_text((chatml / name).read_text())
    cfg = ServingConfig.from_dict({
        "model_config": {"model_path": str(model_dir), "seq_length": [64], "prefill_batch_size": [1],
                         "decode_batch_size": [2]},
        "pa_config": {"num_blocks": 32, "block_size": 8, "decode_seq_length": 96},
        "serving_config": {"num_agents": tp, "compile_cache": False}})
    messages = [{"role": "user", "content": "数据 and naïve text?"}]
    ids = load_chat_template(cfg, model_dir, tok).prompt_ids(messages)
    want = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    with Engine(cfg) as engine:
        engine.start(progress=None)
        assert engine.eos_token_id == end_of_text and end_of_turn in engine.other_eos_token_ids
        result = engine.submit(ids, SamplingParams(max_new_tokens=10, ignore_eos=True)).result(timeout=120)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert result.token_ids == hf_greedy(hf, ids, 10)
    assert len(set(result.token_ids)) > 3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_converter_carries_each_family(models, tmp_path, family):
    """The converted directory (canonical .ckpt, config.json written from our config) is the same model: the same
    config, the same weights with the biases and head norms, each rank's slice readable from the .ckpt."""
    from agents.weights.convert import convert

    model_dir, config, _ = models[family]
    out = convert(model_dir, tmp_path / "converted")
    assert LlamaConfig.from_model_dir(out) == config
    source, converted = load_weights(model_dir, config), load_weights(out, config)
    assert source.keys() == converted.keys()
    for key, value in source.items():
        np.testing.assert_array_equal(converted[key], value, err_msg=key)
    plan = ShardPlan(config, 2, 1)
    for key, value in load_shard(out, config, plan).items():
        np.testing.assert_array_equal(value, load_shard(model_dir, config, plan)[key], err_msg=key)
