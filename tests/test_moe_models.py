"""Qwen3-MoE, Qwen2-MoE (shared expert behind its sigmoid gate) and Mixtral through the Llama layer with the expert
block in its MLP slot (issue 54): checkpoints made by transformers' own classes (random weights, HF layout:
per-expert tensors), greedy ids and log-probabilities equal to transformers' on the native and portable CPU ops,
whole prompts and chunks over cached context, and through the engine. Dense layers between sparse ones
(``mlp_only_layers``, ``decoder_sparse_step``) are in the models, so each key is computed, not assumed."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.protocol.config_errors import ModelConfigError
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.paged_driver import PagedDriver

COMMON = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2, "num_experts_per_tok": 2}
# architecture -> its config's own keys: 16 experts, so a 4-sequence decode gathers its 8 picks and a prefill
# reads every expert once (agents.model.moe's two paths)
FAMILIES = {
    "Qwen3MoeForCausalLM": {"num_hidden_layers": 3, "head_dim": 32, "intermediate_size": 96, "num_experts": 16,
                            "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]},
    "Qwen2MoeForCausalLM": {"num_hidden_layers": 4, "intermediate_size": 96, "num_experts": 16,
                            "moe_intermediate_size": 32, "norm_topk_prob": False, "decoder_sparse_step": 2,
                            "shared_expert_intermediate_size": 48},
    "MixtralForCausalLM": {"num_hidden_layers": 2, "intermediate_size": 32, "num_local_experts": 16},
}
SPARSE = {"Qwen3MoeForCausalLM": (0, 2), "Qwen2MoeForCausalLM": (1, 3), "MixtralForCausalLM": (0, 1)}
PROMPT_LENS = (9, 30, 17)
STEPS = 8
RC = RunnerConfig(num_blocks=32, block_size=16, max_model_len=64, prefill_batch_sizes=(2,),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(4,), decode_block_widths=(4,))


def save_hf_model(arch: str, out, seed: int = 0, **changes):
    """transformers' own model of ``arch`` with random weights (norms near 1), saved as HF writes it."""
    import transformers

    config = transformers.AutoConfig.for_model(_model_type(arch), **{**COMMON, **FAMILIES[arch], **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.05 * torch.randn_like(p))
            else:
                p.normal_(0, 0.25)
    model.save_pretrained(out)
    return model


def _model_type(arch: str) -> str:
    return {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
            "MixtralForCausalLM": "mixtral"}[arch]


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities, never stopped by an end-of-sequence id."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            scores = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
            ids.append(int(scores.argmax()))
            logprobs.append(float(scores[ids[-1]]))
    return ids[len(prompt):], logprobs


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Each family's directory, our config of it, and transformers' greedy ids and log-probabilities."""
    out = {}
    for arch in FAMILIES:
        model_dir = tmp_path_factory.mktemp(arch)
        hf = save_hf_model(arch, model_dir, seed=5)
        refs = [hf_greedy(hf, p, STEPS) for p in prompts()]
        out[arch] = (model_dir, LlamaConfig.from_model_dir(model_dir), refs)
    return out


def runner_for(model_dir, config: LlamaConfig, ops: str) -> ModelRunner:
    rc = dataclasses.replace(RC, kernels=ops, mixed_steps=True, max_num_batched_tokens=32)
    runner = ModelRunner(config, load_weights(model_dir, config), rc)
    runner.warmup()
    return runner


def test_the_config_reads_each_familys_experts_and_sparse_layers(models):
    for arch, (model_dir, config, _) in models.items():
        assert config.architecture == arch and config.moe is not None
        assert config.moe.sparse_layers == SPARSE[arch] and config.moe.num_experts == 16
        # an AgentSpec round trip (JSON) and config.json written back give the same config
        assert LlamaConfig(**json.loads(json.dumps(config.as_dict()))).moe == config.moe
        assert LlamaConfig.from_dict(config.to_hf_dict()) == dataclasses.replace(config, eos_token_ids=(2,))
        weights = load_weights(model_dir, config)
        dense = [i for i in range(config.num_hidden_layers) if i not in SPARSE[arch]]
        assert all(f"layers.{i}.w_gate_up" in weights for i in dense)
        assert all(f"layers.{i}.w_gate_up" not in weights for i in SPARSE[arch])
        assert weights[f"layers.{SPARSE[arch][0]}.experts_gate_up"].shape == (16, 2 * (
            config.moe.moe_intermediate_size), 64)
        assert ("layers.1.shared_gate" in weights) == (arch == "Qwen2MoeForCausalLM")


@pytest.mark.parametrize("arch, ops", [("Qwen3MoeForCausalLM", "native"), ("Qwen3MoeForCausalLM", "portable"),
                                       ("Qwen2MoeForCausalLM", "native"), ("MixtralForCausalLM", "portable"),
                                       ("MixtralForCausalLM", "native")])
def test_greedy_ids_and_logprobs_are_transformers(models, arch, ops):
    """Whole prompts (prefill, then decode), then the same prompts in chunks of 7 over their cached context with
    decodes mixed in; then the counter-check: the router's rows permuted changes the ids, so the equality rests on
    the routing being computed. Native: each sparse layer's MLP slot is one op (``MoeLayer``), routing included,
    Qwen2-MoE's shared expert beside it (``SharedExpert``'s native projections)."""
    from agents.model.llama import load_weights_into

    model_dir, config, refs = models[arch]
    runner = runner_for(model_dir, config, ops)
    assert [runner.model.layers[i].moe.fused for i in SPARSE[arch]] == [ops == "native"] * len(SPARSE[arch])
    tokens, logprobs = PagedDriver(runner, seed=1).generate(prompts(), STEPS)
    assert tokens == [r[0] for r in refs]
    np.testing.assert_allclose(np.array(logprobs), np.array([r[1] for r in refs]), atol=2e-3)
    chunked, _ = ChunkDriver(runner, seed=2).generate(prompts(), STEPS, chunk=7, starts=[0, 2, 3])
    assert chunked == [r[0] for r in refs]
    weights = load_weights(model_dir, config)
    for i in SPARSE[arch]:
        weights[f"layers.{i}.router"] = weights[f"layers.{i}.router"][::-1].copy()
    load_weights_into(runner.model, weights)
    assert PagedDriver(runner, seed=1).generate(prompts(), STEPS)[0] != [r[0] for r in refs]


INT8_KINDS = ("w_qkv", "wo", "w_gate_up", "w_down", "experts_gate_up", "experts_down", "shared_gate_up",
              "shared_down")
# the checkpoint names of what w8a16 holds int8: every projection of attention, dense MLPs, experts, shared experts
INT8_HF_NAMES = re.compile(r"^model\.layers\.\d+\..*(_proj|\.w[123])\.weight$")


def w8a16_values(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The canonical weights with what w8a16 holds dequantized: the dense projections per output row, the routed
    and shared experts per expert and output row (router, shared expert gate, norms and embeddings stay float)."""
    from agents.weights import packed as pw

    out = dict(weights)
    for key, value in weights.items():
        if key.rsplit(".", 1)[-1] in INT8_KINDS:
            flat = value.reshape(-1, value.shape[-1])
            out[key] = pw.dequantize_rows(*pw.quantize_rows(flat)).reshape(value.shape)
    return out


def hf_on_w8a16_values(model_dir, out):
    """transformers' model of a copy of ``model_dir`` whose int8-held projections are their w8a16 values."""
    import shutil

    import transformers
    from safetensors.numpy import load_file, save_file

    from agents.weights import packed as pw

    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors = {k: pw.dequantize_rows(*pw.quantize_rows(v)) if INT8_HF_NAMES.match(k) else v
               for k, v in tensors.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_w8a16_holds_int8_experts_and_serves_the_float_model_on_their_values(models, tmp_path, arch):
    """model_config.quantization w8a16 on a MoE model: every projection, routed expert and shared expert held int8
    (a byte a weight and a float32 scale a row; the router and the shared expert's gate float), and greedy ids and
    log-probabilities equal to the float32 model whose weights are the dequantized int8 ones (exactly the maths
    served), whole prompts and chunks over cached context, and transformers' greedy ids on the checkpoint of those
    values; ``llm-serving quantize``'s checkpoint loaded in place of quantizing at load: the same ids and
    log-probabilities."""
    from agents.model.llama import load_weights_into, model_weights
    from agents.weights.quantize_checkpoint import quantize_checkpoint
    from agents.weights.sharded import load_rank_weights
    from llm_serving.protocol.parallel import ShardPlan

    model_dir, config, _ = models[arch]
    weights = load_weights(model_dir, config)
    values = w8a16_values(weights)
    assert all(np.abs(values[k] - weights[k]).max() > 0 for k in weights if k.rsplit(".", 1)[-1] in INT8_KINDS)
    rc = dataclasses.replace(RC, kernels="native", mixed_steps=True, max_num_batched_tokens=32)
    runners = {name: ModelRunner(config, w, dataclasses.replace(rc, quantization=q))
               for name, w, q in (("w8a16", weights, "w8a16"), ("values", values, "none"))}
    for runner in runners.values():
        runner.warmup()
    p = f"layers.{SPARSE[arch][0]}."
    block = runners["w8a16"].model.layers[SPARSE[arch][0]].moe.block
    e, f, h = config.moe.num_experts, config.moe.moe_intermediate_size, config.hidden_size
    assert [str(w.dtype) for w in (block.experts_gate_up, block.experts_down)] == ["Int8", "Int8"]
    assert block.experts_gate_up.nbytes + block.experts_down.nbytes == 3 * e * f * h
    assert block.experts_gate_up_scale.nbytes + block.experts_down_scale.nbytes == 4 * e * (2 * f + h)
    assert str(block.router.dtype) == "Float32"
    if block.shared is not None:  # int8 panels as the dense MLP's, read back as their dequantized values
        assert [str(w.dtype) for w in (block.shared.gate_up.weight, block.shared.down.weight)] == ["Int8", "Int8"]
        assert str(block.shared.gate.dtype) == "Float32"
        held = model_weights(runners["w8a16"].model)
        for kind in ("shared_gate_up", "shared_down"):
            np.testing.assert_array_equal(held[p + kind], values[p + kind])
    got = PagedDriver(runners["w8a16"], seed=1).generate(prompts(), STEPS)
    want = PagedDriver(runners["values"], seed=1).generate(prompts(), STEPS)
    assert got[0] == want[0]
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    chunked = ChunkDriver(runners["w8a16"], seed=2).generate(prompts(), STEPS, chunk=7, starts=[0, 2, 3])
    assert chunked == ChunkDriver(runners["values"], seed=2).generate(prompts(), STEPS, chunk=7, starts=[0, 2, 3])
    hf = hf_on_w8a16_values(model_dir, tmp_path / "values")
    assert got[0] == [hf_greedy(hf, prompt, STEPS)[0] for prompt in prompts()]
    int8_dir = quantize_checkpoint(model_dir, tmp_path / "int8")
    int8_config = LlamaConfig.from_model_dir(int8_dir)
    load_weights_into(runners["w8a16"].model, load_rank_weights(int8_dir, int8_config, ShardPlan(int8_config),
                                                                quantize=True))
    assert PagedDriver(runners["w8a16"], seed=1).generate(prompts(), STEPS) == got


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_a_ranks_int8_experts_are_the_whole_models_cut(models, tmp_path, expert_parallel):
    """w8a16 at two ranks (Qwen2-MoE: routed and shared experts): each rank's int8 experts, shared expert and
    scales are the one-rank quantization's cut (a down projection's column slice scaled by its whole rows), so every
    degree serves the same numbers; from ``llm-serving quantize``'s checkpoint each rank reads those same tensors;
    the budget counts a byte a weight."""
    from agents.runtime import kv_budget
    from agents.weights import packed as pw
    from agents.weights.quantize_checkpoint import quantize_checkpoint
    from agents.weights.sharded import load_rank_weights
    from llm_serving.protocol.parallel import ShardPlan

    arch = "Qwen2MoeForCausalLM"
    model_dir, config, _ = models[arch]
    int8_dir = quantize_checkpoint(model_dir, tmp_path / "int8")
    int8_config = LlamaConfig.from_model_dir(int8_dir)
    whole = load_weights(model_dir, config)
    f, s, p = config.moe.moe_intermediate_size, config.moe.shared_expert_intermediate_size, f"layers.{SPARSE[arch][0]}."
    for rank in (0, 1):
        plan = ShardPlan(config, 2, rank, expert_parallel)
        shard = load_rank_weights(model_dir, config, plan, quantize=True)
        stored = load_rank_weights(int8_dir, int8_config, ShardPlan(int8_config, 2, rank, expert_parallel),
                                   quantize=True)
        assert stored.keys() == shard.keys()
        for key, value in shard.items():
            assert stored[key].dtype == value.dtype, key
            np.testing.assert_array_equal(stored[key], value, err_msg=key)
        (e0, e1), (f0, f1), (s0, s1) = plan.expert_range(), plan.expert_ffn_range(), plan.shared_ffn_range()
        wanted = {"experts_gate_up": (whole[p + "experts_gate_up"][e0:e1], f, (f0, f1)),
                  "experts_down": (whole[p + "experts_down"][e0:e1], None, (f0, f1)),
                  "shared_gate_up": (whole[p + "shared_gate_up"][None], s, (s0, s1)),
                  "shared_down": (whole[p + "shared_down"][None], None, (s0, s1))}
        for kind, (value, half, (lo, hi)) in wanted.items():
            q, scale = pw.quantize_rows(value.reshape(-1, value.shape[-1]))
            q, scale = q.reshape(value.shape), scale.reshape(value.shape[:2])
            if half is not None:  # gate/up: the rank's rows of each half
                q, scale = (np.concatenate([a[:, lo:hi], a[:, half + lo:half + hi]], 1) for a in (q, scale))
            else:  # down: the rank's columns, each row scaled by the whole row
                q = q[:, :, lo:hi]
            if kind.startswith("shared"):
                q, scale = q[0], scale[0]
            np.testing.assert_array_equal(shard[p + kind], q, err_msg=kind)
            np.testing.assert_array_equal(shard[f"{p}{kind}.scale"], scale, err_msg=kind)
        assert shard[p + "router"].dtype == np.float32 and shard[p + "shared_gate"].dtype == np.float32
        int8 = kv_budget.weight_bytes(shard, "float32", quantized=True)
        as_float = {k: v.astype(np.float32) for k, v in shard.items() if not k.endswith(".scale")}
        held_int8 = sum(v.size for v in shard.values() if v.dtype == np.int8)
        scales = sum(v.size for k, v in shard.items() if k.endswith(".scale"))
        assert held_int8 > sum(shard[f"layers.{i}.{k}"].size for i in SPARSE[arch] for k in wanted)  # among them
        assert kv_budget.weight_bytes(as_float, "float32") - int8 == 3 * held_int8 - 4 * scales


@pytest.mark.parametrize(("change", "named"), [({"capacity_factor": 1.5}, "capacity_factor"),
                                               ({"qkv_bias": False}, "qkv_bias"),
                                               ({"mlp_only_layers": [9]}, "mlp_only_layers")])
def test_configs_that_change_the_maths_are_refused_by_name(tmp_path, change, named):
    raw = {**COMMON, **FAMILIES["Qwen2MoeForCausalLM"], **change, "architectures": ["Qwen2MoeForCausalLM"],
           "model_type": "qwen2_moe"}
    with pytest.raises(ModelConfigError, match=f"config.json: {named}"):
        LlamaConfig.from_dict(raw, source="config.json")
    mixtral = {**COMMON, **FAMILIES["MixtralForCausalLM"], "architectures": ["MixtralForCausalLM"],
               "model_type": "mixtral", "decoder_sparse_step": 2}
    with pytest.raises(ModelConfigError, match="decoder_sparse_step"):
        LlamaConfig.from_dict(mixtral, source="config.json")


def test_a_missing_expert_is_named(models, tmp_path):
    from safetensors.numpy import load_file, save_file

    from agents.weights.errors import WeightLoadError

    model_dir, config, _ = models["MixtralForCausalLM"]
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="experts.5.w3.weight"):
        load_weights(tmp_path / "model.safetensors", config)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Qwen3-MoE directory with a ChatML tokenizer (what the engine loads), and transformers' model of it."""
    from llm_serving.tokenization.hf_tokenizer import load_tokenizer
    from tests.hf_tokenizer_fixture import build_chatml_tokenizer

    chatml = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    model_dir = tmp_path_factory.mktemp("served")
    hf = save_hf_model("Qwen3MoeForCausalLM", model_dir, seed=4, vocab_size=load_tokenizer(chatml).vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_text((chatml / name).read_text())
    return model_dir, hf


def serve_and_compare(model_dir, hf, ranks: int, expert_parallel: bool = False, quantization: str = "none") -> None:
    from llm_serving.config.serving_config import ServingConfig
    from llm_serving.core.sequence import SamplingParams
    from llm_serving.engine.loop import Engine

    cfg = ServingConfig.from_dict({
        "model_config": {"model_path": str(model_dir), "seq_length": [64], "prefill_batch_size": [2],
                         "decode_batch_size": [2], "expert_parallel": expert_parallel,
                         "quantization": quantization},
        "pa_config": {"num_blocks": 32, "block_size": 8, "decode_seq_length": 96},
        "serving_config": {"num_agents": ranks, "compile_cache": False}})
    rng = np.random.default_rng(9)
    asks = [rng.integers(3, 200, n).tolist() for n in (12, 25, 7)]
    with Engine(cfg) as engine:
        engine.start(progress=None)
        futures = [engine.submit(ids, SamplingParams(max_new_tokens=8, ignore_eos=True)) for ids in asks]
        results = [f.result(timeout=300) for f in futures]
    for ids, result in zip(asks, results):
        assert result.token_ids == hf_greedy(hf, ids, 8)[0]


@pytest.mark.parametrize("ranks, int8_checkpoint", [(1, False), (2, True)])
def test_the_engine_serves_w8a16_moe_as_transformers_on_the_dequantized_checkpoint(served, tmp_path, ranks,
                                                                                  int8_checkpoint):
    """model_config.quantization w8a16 through the engine: at one rank quantized at load, at TP 2 from
    ``llm-serving quantize``'s int8 checkpoint (each rank reads its experts' int8 slices with their stored scales,
    a down projection's columns with their whole rows' scales): transformers' greedy ids on the checkpoint whose
    projections and experts are their int8 values (one of the three asks' ids differs from the float
    checkpoint's)."""
    import transformers

    from llm_serving.cli.main import main as cli
    from tests.test_quantization import dequantized_checkpoint

    model_dir, _ = served
    values = dequantized_checkpoint(model_dir, tmp_path / "dequantized")
    hf = transformers.AutoModelForCausalLM.from_pretrained(values, dtype=torch.float32).eval()
    if int8_checkpoint:
        assert cli(["quantize", "--model", str(model_dir), "--out", str(tmp_path / "int8")]) == 0
        model_dir = tmp_path / "int8"
    serve_and_compare(model_dir, hf, ranks, quantization="w8a16")


@pytest.mark.parametrize("ranks, expert_parallel", [(1, False), (2, False), (2, True), (4, True)])
def test_the_engine_serves_a_moe_directory(served, ranks, expert_parallel):
    """Tensor parallel (every expert cut over the ranks) and expert parallel (16 experts whole, 8 or 4 a rank;
    at 4 ranks the kv heads replicated): transformers' greedy ids, as at one rank."""
    serve_and_compare(*served, ranks=ranks, expert_parallel=expert_parallel)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_each_rank_reads_its_experts_slice(models, tmp_path, arch, expert_parallel):
    """From the HF directory and from the converted .ckpt: the router whole, the rank's experts (whole, or each
    one's gate/up rows and down columns) and its share of the shared expert, cut from the whole model's tensors."""
    from agents.weights.convert import convert
    from agents.weights.sharded import load_shard, shard_shapes
    from llm_serving.protocol.parallel import ShardPlan

    model_dir, config, _ = models[arch]
    full = load_weights(model_dir, config)
    converted = convert(model_dir, tmp_path / "converted")
    assert LlamaConfig.from_model_dir(converted).moe == config.moe
    layer = f"layers.{SPARSE[arch][-1]}."
    for rank in range(2):
        plan = ShardPlan(config, 2, rank, expert_parallel)
        e0, e1 = plan.expert_range()
        lo, hi = plan.expert_ffn_range()
        f = config.moe.moe_intermediate_size
        assert (e1 - e0, hi - lo) == ((8, f) if expert_parallel else (16, f // 2))
        for source in (model_dir, converted):
            got = load_shard(source, config, plan)
            assert {k: v.shape for k, v in got.items()} == shard_shapes(config, plan)
            np.testing.assert_array_equal(got[layer + "router"], full[layer + "router"])
            gate_up = full[layer + "experts_gate_up"][e0:e1]
            np.testing.assert_array_equal(got[layer + "experts_gate_up"], np.concatenate(
                [gate_up[:, lo:hi], gate_up[:, f + lo:f + hi]], 1))
            np.testing.assert_array_equal(got[layer + "experts_down"], full[layer + "experts_down"][e0:e1, :, lo:hi])
            if config.moe.shared_expert_intermediate_size:
                s0, s1 = plan.shared_ffn_range()
                np.testing.assert_array_equal(got[layer + "shared_down"], full[layer + "shared_down"][:, s0:s1])


def test_expert_counts_the_ranks_cannot_split_are_refused_by_name(served, tmp_path):
    import shutil

    from llm_serving.config.serving_config import ConfigError, ServingConfig
    from llm_serving.engine.wiring import resolve_model

    shutil.copytree(served[0], tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_local_experts": 6}))
    for ep, ranks in ((True, 4), (False, 2)):
        cfg = ServingConfig.from_dict({"model_config": {"model_path": str(tmp_path), "expert_parallel": ep},
                                       "serving_config": {"num_agents": ranks}})
        if ep:
            with pytest.raises(ConfigError, match="num_agents.*num_experts 6 is not divisible by 4 ranks.*"
                                                  "model_config.expert_parallel"):
                resolve_model(cfg, tokenizer=False)
        else:
            assert resolve_model(cfg, tokenizer=False).llama_config.moe.num_experts == 6
    dense = ServingConfig.from_dict({"model_config": {"expert_parallel": True}, "serving_config": {"num_agents": 2},
                                     "default_model": {"data_dir": str(tmp_path / "default")}})
    with pytest.raises(ConfigError, match="expert_parallel: the model has no experts"):
        resolve_model(dense, tokenizer=False)
    adapters = ServingConfig.from_dict({"model_config": {"model_path": str(tmp_path)}, "lora": {"enable": True}})
    with pytest.raises(ConfigError, match="lora.enable: Qwen3MoeForCausalLM is a mixture-of-experts model"):
        resolve_model(adapters, tokenizer=False)


@pytest.mark.parametrize("tp, rank, expert_parallel, quantization", [(1, 0, False, "none"), (2, 1, True, "none"),
                                                                  (2, 1, True, "w8a16")])
def test_the_ascend_graphs_of_a_moe_model_export_and_pass_the_contract_check(tmp_path, tp, rank, expert_parallel,
                                                                             quantization):
    """On the Ascend backend's graphs in float16 (its attention kernels, the sparse layers on its MoE kernels,
    agents/model/backends/ascend_moe.py): every rule of agents.tools.contracts holds, one rank of two at expert
    parallelism included, w8a16 too (int8 experts with antiquant scales); per sparse layer one gating top-k and two
    grouped matmuls, and one all-reduce per row-parallel slot."""
    from agents.tools.contracts import check_graph
    from agents.tools.export import export_graphs, export_runner
    from agents.tools.mindir import read_graph
    from agents.weights.sharded import load_rank_weights
    from llm_serving.protocol.parallel import ShardPlan

    save_hf_model("Qwen3MoeForCausalLM", tmp_path, seed=1, head_dim=64)  # a head_dim FlashAttentionScore takes
    config = LlamaConfig.from_model_dir(tmp_path)
    plan = ShardPlan(config, tp, rank, expert_parallel)
    rc = dataclasses.replace(RC, dtype="float16", device_target="Ascend", decode_batch_sizes=(1, 4),
                             quantization=quantization)
    weights = load_rank_weights(tmp_path, config, plan, np.float16, quantize=quantization != "none")
    runner = export_runner(config, rc, weights, shard=plan)
    for _, summary in export_graphs(runner, tmp_path / "graphs", [("decode", 4, 4), ("ragged", 2, 48)]):
        graph = read_graph(summary.path)
        assert check_graph(graph, tensor_parallel=tp) == [], summary.path.name
        sparse = len(SPARSE["Qwen3MoeForCausalLM"])
        assert len(graph.of("MoeGatingTopKSoftmax")) == sparse and len(graph.of("GroupedMatmulV4")) == 2 * sparse
        assert not graph.of("TopK")
        int8 = [n for n in graph.of("GroupedMatmulV4") if n.inputs[1].info.dtype == "int8"]
        assert len(int8) == (2 * sparse if quantization != "none" else 0)
        assert len(graph.of("AllReduce")) == (1 + 2 * config.num_hidden_layers if tp > 1 else 0)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_the_ascend_moe_wiring_on_the_kernels_stand_ins_is_transformers(tmp_path, arch):
    """The Ascend backend's graphs with every fused kernel's CPU stand-in, the MoE kernels' included
    (agents/model/backends/ascend_moe_reference.py), in float32: transformers' greedy ids, whole prompts and in
    chunks over the cached context; the experts held transposed for the grouped matmul, read back as loaded.
    Qwen3-MoE's routing (renormalised) and Qwen2-MoE's (not, plus the shared expert); Mixtral's is Qwen3-MoE's
    without the head norms, which the dense Ascend tests hold."""
    from agents.model.backends.ascend import AscendBackend
    from agents.model.backends.ascend_reference import ReferenceOps
    from agents.model.llama import model_weights

    hf = save_hf_model(arch, tmp_path, seed=6, head_dim=64)
    config = LlamaConfig.from_model_dir(tmp_path)
    weights = load_weights(tmp_path, config)
    rc = dataclasses.replace(RC, mixed_steps=True, max_num_batched_tokens=32)
    runner = ModelRunner(config, weights, rc, AscendBackend(ReferenceOps(config.head_dim)))
    runner.warmup()
    sparse = SPARSE[arch][0]
    held = runner.model.layers[sparse].moe.block.experts_gate_up
    assert tuple(held.shape) == (16, 64, 2 * config.moe.moe_intermediate_size)  # [experts, in, out]
    np.testing.assert_array_equal(model_weights(runner.model)[f"layers.{sparse}.experts_gate_up"],
                                  weights[f"layers.{sparse}.experts_gate_up"])
    refs = [hf_greedy(hf, p, STEPS)[0] for p in prompts()]
    assert PagedDriver(runner, seed=1).generate(prompts(), STEPS)[0] == refs
    assert ChunkDriver(runner, seed=2).generate(prompts(), STEPS, chunk=7, starts=[0, 2, 3])[0] == refs


def test_w8a16_on_the_ascend_moe_kernels_stand_ins_is_the_native_int8_model(tmp_path):
    """w8a16 on the Ascend backend's graphs (stand-ins, float32): the experts int8 [experts, in, out] with their
    antiquant scales, read back dequantized as loaded, and the native CPU w8a16 model's greedy ids."""
    from agents.model.backends.ascend import AscendBackend
    from agents.model.backends.ascend_reference import ReferenceOps
    from agents.model.llama import model_weights

    save_hf_model("Qwen3MoeForCausalLM", tmp_path, seed=6, head_dim=64)  # a head_dim FlashAttentionScore takes
    config = LlamaConfig.from_model_dir(tmp_path)
    weights = load_weights(tmp_path, config)
    rc = dataclasses.replace(RC, mixed_steps=True, max_num_batched_tokens=32, quantization="w8a16")
    runner = ModelRunner(config, weights, rc, AscendBackend(ReferenceOps(config.head_dim)))
    runner.warmup()
    block = runner.model.layers[0].moe.block
    assert str(block.experts_down.dtype) == "Int8" and tuple(block.experts_down.shape) == (16, 32, 64)
    assert tuple(block.experts_down_scale.shape) == (16, 64)
    np.testing.assert_array_equal(model_weights(runner.model)["layers.0.experts_down"],
                                  w8a16_values(weights)["layers.0.experts_down"])
    native = ModelRunner(config, weights, dataclasses.replace(rc, kernels="native"))
    native.warmup()
    assert PagedDriver(runner, seed=1).generate(prompts(), STEPS)[0] == \
        PagedDriver(native, seed=1).generate(prompts(), STEPS)[0]
