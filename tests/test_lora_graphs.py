"""Issue 56, LoRA adapters in the step graphs: three PEFT adapters of different ranks and targets in the runner's
slots, their rows mixed with base rows in one batch, give PEFT's own greedy ids and log-probabilities (and last
logits) through prefill, decode and chunked prefill over cached context, on both CPU kernel paths; loading and
unloading while serving changes only the slot's rows. The reference is an unmerged ``PeftModel`` per adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.hf_reference import hf_greedy, model_logits
from tests.paged_driver import PagedDriver

peft = pytest.importorskip("peft")

# head_dim 64: the native kernels' AVX-512 loops
CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
RC = RunnerConfig(num_blocks=120, block_size=4, max_model_len=64, prefill_batch_sizes=(4,), prefill_seq_lengths=(32,),
                  decode_batch_sizes=(4,), decode_block_widths=(16,), mixed_steps=True, max_num_batched_tokens=32,
                  decode_steps=3)  # the looped decode graphs too (test_looped_decode_steps_with_adapters_match_peft)
LORA = {"max_loras": 3, "max_lora_rank": 8}
# three adapters of different ranks and targets (PEFT LoraConfig keywords)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attention": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]},
    "everything": {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL,
                   "rank_pattern": {"down_proj": 2}, "layers_to_transform": [1]},
    "mlp": {"r": 2, "lora_alpha": 5,
            "target_modules": r".*\.1\.mlp\.(gate|up)_proj|.*\.0\.self_attn\.k_proj|.*down_proj"},
}
NAMES = sorted(ADAPTERS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("lora-graphs"), CONFIG, seed=5, std=0.15)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """name -> (adapter directory, PEFT's unmerged model with it)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for seed, name in enumerate(NAMES):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
        with torch.no_grad():  # B scaled so each adapter moves the logits by about what the base weights do
            for module_name, param in model.named_parameters():
                if "lora_B" in module_name:
                    param.mul_(0.5)
        directory = tmp_path_factory.mktemp("adapter") / name
        model.save_pretrained(directory)
        out[name] = (directory, model.eval())
    return out


@pytest.fixture(scope="module")
def base_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["native", "portable"])
def runner(request, model_dir):
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), RunnerConfig(**{**RC.__dict__,
                                                                                 "kernels": request.param}),
                         lora=LORA)
    assert runner.kernels == request.param
    runner.warmup()
    return runner


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, int(k)).tolist()
            for k in rng.integers(3, 30, n)]


def reference(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    return hf_greedy(hf, prompt, steps)


def load_all(runner, adapters) -> list:
    """The three adapters in slots 0..2; the reference model of each slot, and of -1 (base) last."""
    for slot, name in enumerate(NAMES):
        runner.load_adapter(slot, str(adapters[name][0]))
    return [adapters[name][1] for name in NAMES]


def check(got: tuple, refs: list[tuple], n: int) -> None:
    for tokens, logprobs, (ref_tokens, ref_logprobs) in zip(*got, refs):
        assert tokens == ref_tokens[:n]
        np.testing.assert_allclose(logprobs, ref_logprobs[:n], atol=1e-4)


def test_adapters_mixed_with_base_rows_match_peft_in_prefill_and_decode(runner, adapters, base_hf):
    models = load_all(runner, adapters) + [base_hf]
    slots = [0, -1, 2, 1]  # one row per adapter and a base row, in one batch
    batch_prompts = prompts(4, seed=1)
    refs = [reference(models[s], p, 6) for s, p in zip(slots, batch_prompts)]
    assert len({tuple(r[0]) for r in refs}) == 4  # the adapters change the answers
    check(PagedDriver(runner, seed=2).generate(batch_prompts, 6, lora_slots=slots), refs, 6)
    # the same rows without adapters: the base model's answers
    base_refs = [reference(base_hf, p, 6) for p in batch_prompts]
    check(PagedDriver(runner, seed=3).generate(batch_prompts, 6), base_refs, 6)


def test_last_logits_of_a_mixed_prefill_are_peft_s(runner, adapters, base_hf):
    models = load_all(runner, adapters) + [base_hf]
    slots = [2, 0, -1, 1]
    batch_prompts = prompts(4, seed=4)
    lens = np.array([len(p) for p in batch_prompts], np.int32)
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    batch = StepBatch(np.concatenate(batch_prompts).astype(np.int32),
                      np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
                      np.array([blocks[i][j // 4] * 4 + j % 4 for i, n in enumerate(lens) for j in range(n)],
                               np.int32), lens, lens.copy(), np.array(blocks, np.int32),
                      lora_slots=np.array(slots, np.int32))
    got = runner.step_logits(batch)
    for row, (slot, prompt) in enumerate(zip(slots, batch_prompts)):
        np.testing.assert_allclose(got[row], model_logits(models[slot], prompt).numpy(), atol=2e-4)


def test_chunked_prefill_over_cached_context_with_adapters_matches_peft(runner, adapters, base_hf):
    models = load_all(runner, adapters) + [base_hf]
    slots = [1, -1, 0, 2]
    batch_prompts = prompts(4, seed=5)
    refs = [reference(models[s], p, 4) for s, p in zip(slots, batch_prompts)]
    # chunks of 7 joining while others decode
    check(ChunkDriver(runner, seed=6).generate(batch_prompts, 4, 7, [0, 1, 3, 2], lora_slots=slots), refs, 4)


def test_a_slot_loaded_and_emptied_while_serving_serves_its_new_adapter(runner, adapters, base_hf):
    models = load_all(runner, adapters)
    batch_prompts = prompts(2, seed=7)
    refs = [reference(models[0], batch_prompts[0], 3), reference(models[1], batch_prompts[1], 3)]
    check(PagedDriver(runner, seed=8).generate(batch_prompts, 3, lora_slots=[0, 1]), refs, 3)
    runner.load_adapter(0, None)  # emptied: the base model
    runner.load_adapter(1, str(adapters[NAMES[2]][0]))  # reused for another adapter
    refs = [reference(base_hf, batch_prompts[0], 3), reference(models[2], batch_prompts[1], 3)]
    check(PagedDriver(runner, seed=9).generate(batch_prompts, 3, lora_slots=[0, 1]), refs, 3)


def test_an_adapter_that_does_not_fit_is_refused_and_the_slot_kept(runner, adapters, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    models = load_all(runner, adapters)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    big = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=["q_proj"], init_lora_weights=False))
    big.save_pretrained(tmp_path / "big")
    with pytest.raises(ValueError, match="rank 16, above the slots' max_lora_rank 8"):
        runner.load_adapter(0, str(tmp_path / "big"))
    with pytest.raises(ValueError, match="slot 3 is not one of the 3 slots"):
        runner.load_adapter(3, str(adapters[NAMES[0]][0]))
    with pytest.raises(ValueError, match="adapter_config.json"):
        runner.load_adapter(0, str(tmp_path))
    prompt = prompts(1, seed=10)
    check(PagedDriver(runner, seed=11).generate(prompt, 3, lora_slots=[0]), [reference(models[0], prompt[0], 3)], 3)


@pytest.fixture(scope="module")
def tp2_pool(model_dir):
    """Two tensor-parallel ranks (agent processes, loopback) with the adapter slots."""
    from llm_serving.executor.agent_pool import AgentPool
    from llm_serving.protocol.wire import AgentSpec

    fields = {"device_target": "CPU", "device_id": 0, "num_blocks": RC.num_blocks, "block_size": RC.block_size,
              "max_model_len": RC.max_model_len,
              "prefill_batch_sizes": [4], "prefill_seq_lengths": [32], "decode_batch_sizes": [4],
              "decode_block_widths": [16], "mixed_steps": True, "max_num_batched_tokens": 32}
    spec = AgentSpec("llama", str(model_dir), CONFIG.__dict__.copy(), fields, 128, 4, 16, tensor_parallel_size=2,
                     lora=LORA)
    with AgentPool(spec) as pool:
        pool.start()
        yield pool


class PoolRunner:
    """The drivers' view of a pool: its steps and cache shape."""

    def __init__(self, pool) -> None:
        self.pool, self.rc = pool, RC

    def step(self, batch: StepBatch):
        return self.pool.run_step(batch)

    def load_adapter(self, slot: int, path: str | None) -> None:
        from llm_serving.protocol.batch import AdapterStep

        self.pool.run_step(AdapterStep(slot, path))


def test_tensor_parallel_ranks_serve_peft_s_answers(tp2_pool, adapters, base_hf):
    """TP 2: each rank holds its slices of A and B; the row-parallel projections' partial updates are summed by
    their all-reduce."""
    runner = PoolRunner(tp2_pool)
    models = load_all(runner, adapters) + [base_hf]
    slots = [0, -1, 2, 1]
    batch_prompts = prompts(4, seed=12)
    refs = [reference(models[s], p, 4) for s, p in zip(slots, batch_prompts)]
    check(PagedDriver(runner, seed=13).generate(batch_prompts, 4, lora_slots=slots), refs, 4)
    check(ChunkDriver(runner, seed=14).generate(batch_prompts, 4, 7, [0, 2, 1, 0], lora_slots=slots), refs, 4)
    runner.load_adapter(2, None)  # emptied while serving: its rows are the base model's again
    check(PagedDriver(runner, seed=15).generate(batch_prompts[2:3], 3, lora_slots=[2]),
          [reference(base_hf, batch_prompts[2], 3)], 3)


def test_ascend_graphs_with_adapters_export_and_pass_the_contract_check(model_dir, tmp_path):
    """The Ascend float16 graphs with adapter slots, exported on this CPU (``agents.tools.export``): the updates are
    plain MatMuls (MindSpore 2.10 has no LoRA primitive), the norms and SwiGLU stay the fused RmsNorm and Swiglu,
    and the contract checker passes both graphs."""
    import subprocess
    import sys

    from llm_serving.protocol.wire import AgentSpec

    fields = {"device_target": "Ascend", "device_id": 0, "dtype": "float16", "num_blocks": 40, "block_size": 16,
              "max_model_len": 64, "prefill_batch_sizes": [2], "prefill_seq_lengths": [32],
              "decode_batch_sizes": [1, 4]}
    spec = AgentSpec("llama", str(model_dir), CONFIG.__dict__.copy(), fields, 64, 4, 4, lora=LORA)
    res = subprocess.run([sys.executable, "-m", "agents.tools.export", "--spec", spec.to_json(), "--out",
                          str(tmp_path), "--check", "--shape", "decode:4:4", "--shape", "ragged:2:48"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    for name in ("decode_b4_w4", "ragged_b2_t48"):
        assert f"check {name}.mindir: every contract rule holds" in res.stdout
        graph = (tmp_path / f"{name}.mindir").read_bytes()
        assert b"layers.1.lora.lora_qkv.a" in graph and b"lora_masks.blocks" in graph
    assert "RmsNorm x5, Swiglu x2" in res.stdout  # the update and the projection share each norm (one RmsNorm)


def test_looped_decode_steps_with_adapters_match_peft(runner, adapters, base_hf):
    """Several decode steps in one graph call (scheduler.decode_steps): the later steps' blocks, allocated ahead in
    the tables, name the row's slot too."""
    from tests.test_looped_decode import looped_generate

    models = load_all(runner, adapters) + [base_hf]
    slots = [2, -1, 0]
    batch_prompts = prompts(3, seed=16)
    got = looped_generate(runner, batch_prompts, 10, 3, lora_slots=slots)  # crosses blocks inside calls
    check(got, [reference(models[s], p, 10) for s, p in zip(slots, batch_prompts)], 10)
