"""Chunked prefill and prefix caching on the Ascend backend's graphs, checked on CPU with the stand-ins of the
fused primitives (agents/model/backends/ascend_reference.py): queries over cached context go through
PagedAttention's multi-token path (``q_seq_lens``, a mask row per query), as vllm-mindspore runs them. Greedy
ids equal Hugging Face's for prompts from 1 token to max_model_len - 1, chunked alone and mixed with decodes,
and a prefix-cache hit gives the cold run's tokens; the mixed graphs export and pass ``export --check``."""

from __future__ import annotations

import numpy as np
import pytest

from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.tools.contracts import check_graph
from agents.tools.export import export_graphs, export_runner
from agents.tools.mindir import TensorInfo, read_graph
from agents.weights.checkpoints import load_weights
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import SamplingParams, Sequence
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.chunk_driver import ChunkDriver
from tests.hf_reference import hf_greedy, load_hf
from tests.test_chunked_model import serve
from tests.test_speculative import check_oracle_run

CONFIG = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=192, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # head_dim 64
MAX_LEN, BUDGET = 96, 48
RC = RunnerConfig(num_blocks=60, block_size=16, max_model_len=MAX_LEN, prefill_batch_sizes=(2,),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(8,), decode_block_widths=(6,), mixed_steps=True,
                  max_num_batched_tokens=BUDGET)
LENGTHS = (1, 2, 15, 17, 33, 47, 49, 95)  # around the block size (16), the prefill bucket and the budget


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("chunked"), CONFIG, seed=5, std=0.15)


@pytest.fixture(scope="module")
def runner(model_dir):
    setup_device("CPU", 0)
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), RC, AscendBackend(ReferenceOps(CONFIG.head_dim)))
    runner.warmup()
    assert {shape[0] for shape in runner.warmed} == {"ragged", "mixed", "decode"}
    return runner


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, n - 1).tolist() for n in LENGTHS]


def test_chunks_alone_and_mixed_with_decodes_match_hugging_face(runner, model_dir):
    hf = load_hf(model_dir)
    batch_prompts = prompts()
    steps = [min(4, MAX_LEN - len(p)) for p in batch_prompts]
    references = [hf_greedy(hf, p, n) for p, n in zip(batch_prompts, steps)]
    runs = [([i], 24, None) for i in (2, 4, 6)]  # alone, chunks of 24 (not a multiple of the block size)
    runs.append((list(range(len(batch_prompts) - 1)), 7, [0, 0, 1, 3, 2, 6, 4]))  # seven joining while others decode
    runs.append(([len(batch_prompts) - 1], 40, None))  # max_model_len - 1 tokens: one new token
    for rows, chunk, starts in runs:
        n = min(steps[i] for i in rows)
        tokens, logprobs = ChunkDriver(runner, seed=rows[0]).generate([batch_prompts[i] for i in rows], n, chunk,
                                                                     starts)
        for i, got, got_lp in zip(rows, tokens, logprobs):
            assert got == references[i][0][:n], i
            np.testing.assert_allclose(got_lp, references[i][1][:n], atol=1e-4)


def test_mixed_lengths_cover_every_row_with_a_padding_sequence_of_their_own(runner):
    backend = runner.backend
    query, context = backend.mixed_lengths(np.array([3, 1, 0, 0], np.int32), np.array([9, 4, 0, 0], np.int32), 16)
    assert query.tolist() == [3, 1, 1, 15] and context.tolist() == [9, 4, 1, 15]  # 16 rows + 4 appended
    with pytest.raises(ValueError, match="keeps its last sequence slot"):
        backend.mixed_lengths(np.array([3, 1, 2, 1], np.int32), np.array([9, 4, 2, 1], np.int32), 16)


def test_a_prefix_cache_hit_gives_the_cold_runs_tokens(runner):
    cfg = SchedulerConfig(num_blocks=RC.num_blocks, block_size=RC.block_size, max_num_seqs=7, max_prefill_batch=2,
                          max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, eos_token_id=None,
                          chunked_prefill=True, prefix_caching=True)
    rng = np.random.default_rng(3)
    system = [CONFIG.bos_token_id] + rng.integers(3, CONFIG.vocab_size, 47).tolist()  # 3 full blocks
    prompt = system + rng.integers(3, CONFIG.vocab_size, 10).tolist()
    cold = Sequence("cold", prompt, SamplingParams(6))
    serve(Scheduler(cfg), runner, [cold])
    warm = Scheduler(cfg)
    others = [Sequence(f"o{i}", system + rng.integers(3, CONFIG.vocab_size, 3 + i).tolist(), SamplingParams(8))
              for i in range(3)]
    serve(warm, runner, others[:1])
    hit = Sequence("hit", prompt, SamplingParams(6))
    serve(warm, runner, others[1:] + [hit])
    assert warm.prefix_cache_stats()["prefix_cache_hit_tokens"] >= 3 * 48
    assert hit.output_ids == cold.output_ids
    np.testing.assert_allclose(hit.output_logprobs, cold.output_logprobs, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_mixed_graphs_export_and_pass_the_contract_check(tmp_path, model_dir, dtype):
    rc = RunnerConfig(**{**RC.__dict__, "dtype": dtype, "device_target": "Ascend"})
    exporter = export_runner(CONFIG, rc, load_weights(model_dir, CONFIG))
    shapes = [s for s in exporter.graph_shapes() if s[0] == "mixed"]
    assert shapes
    for shape, graph in export_graphs(exporter, tmp_path, shapes[:2]):
        assert graph.fused()["PagedAttention"] == CONFIG.num_hidden_layers, shape
        assert "q_seq_lens" in read_graph(graph.path).inputs, shape
        assert [str(v) for v in check_graph(read_graph(graph.path))] == [], shape


@pytest.fixture(scope="module")
def verify_runner(model_dir):
    """The Ascend graphs with verify steps (speculative decoding), on the reference ops."""
    setup_device("CPU", 0)
    rc = RunnerConfig(**{**RC.__dict__, "verify_tokens": 3})
    runner = ModelRunner(CONFIG, load_weights(model_dir, CONFIG), rc, AscendBackend(ReferenceOps(CONFIG.head_dim)))
    runner.warmup()
    assert "verify" in {shape[0] for shape in runner.warmed}
    return runner


def test_verified_proposals_give_hugging_faces_greedy_tokens(verify_runner, model_dir):
    """The verify graph (PagedAttention over the cache with q_seq_lens, a pick after every query token) keeps
    exactly the greedy tokens, whether it accepts every proposal, some or none."""
    hf = load_hf(model_dir)
    batch_prompts = prompts(4)[2:7]  # none a prefix of another
    references = {tuple(p): hf_greedy(hf, p, min(12, MAX_LEN - len(p))) for p in batch_prompts}
    cfg = SchedulerConfig(num_blocks=RC.num_blocks, block_size=RC.block_size, max_num_seqs=7, max_prefill_batch=2,
                          max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, eos_token_id=None,
                          chunked_prefill=True, speculative="ngram", num_speculative_tokens=3,
                          speculative_step_tokens=64, speculative_min_accepted=0)
    check_oracle_run(Scheduler(cfg), verify_runner, references, CONFIG.vocab_size)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_verify_graphs_export_and_pass_the_contract_check(tmp_path, model_dir, dtype):
    rc = RunnerConfig(**{**RC.__dict__, "dtype": dtype, "device_target": "Ascend", "verify_tokens": 3})
    exporter = export_runner(CONFIG, rc, load_weights(model_dir, CONFIG))
    shapes = [s for s in exporter.graph_shapes() if s[0] == "verify"]
    assert shapes and shapes[-1][2] >= RC.decode_batch_sizes[-1] * 4  # a full decode batch of 3 proposals each
    for shape, graph in export_graphs(exporter, tmp_path, [shapes[0], shapes[-1]]):
        tokens = shape[2]
        assert graph.fused()["PagedAttention"] == CONFIG.num_hidden_layers, shape
        assert graph.outputs == (TensorInfo("int32", (tokens,)), TensorInfo("float32", (tokens,)),
                                 TensorInfo("float32", (tokens, CONFIG.vocab_size))), shape  # a pick per row
        assert "q_seq_lens" in read_graph(graph.path).inputs, shape
        assert [str(v) for v in check_graph(read_graph(graph.path))] == [], shape
