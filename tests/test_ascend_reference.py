"""What the Ascend graphs compute, checked on CPU.

1. Each fused primitive's contract: the numpy reference (agents/tools/preflight/references.py) against the CPU stand-in
   (agents/model/backends/ascend_reference.py) on Ascend-layout tensors: block caches ``[num_blocks, block_size,
   kv_heads, head_dim]``, padded block-table entries, context lengths, ``TH`` per-sequence lengths, GQA grouping,
   slot mappings with padding slots.
2. The Ascend backend's wiring (the same cells, caches and graph as on the NPU, with the stand-ins in place of
   the primitives) against Hugging Face: greedy ids equal in float32; in float16, against Hugging Face in float16,
   ids equal except at Hugging Face's own near-ties (its logits of the two tokens within ``FP16_TIE``), and
   logprobs within ``FP16_LOGPROB`` until then.
"""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import (
    FlashAttentionThRef,
    PagedAttentionRef,
    ReferenceOps,
    ReshapeAndCacheRef,
    RmsNormRef,
    RopeRef,
    SwigluRef,
)
from agents.model.llama import rotary_tables
from agents.runtime.device import setup_device
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.tools.preflight import references as contract
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import check_greedy_near, hf_greedy, hf_last_logits, load_hf
from tests.paged_driver import PagedDriver, contiguous_prefill

# float16 against Hugging Face float16: about twice Hugging Face float16's own distance from its float32 run on
# these models (logprobs up to 0.042 apart), since both round, in different places
FP16_TIE = 0.1  # largest gap between Hugging Face float16 logits of its token and ours where ids may differ
FP16_LOGPROB = 0.1  # logprobs before any differing token
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16  # GQA: four query heads per kv head


@pytest.fixture(scope="module", autouse=True)
def cpu():
    setup_device("CPU", 0)


def run(cell: nn.Cell, *arrays):
    out = cell(*[Tensor(a) if isinstance(a, np.ndarray) else a for a in arrays])
    return tuple(o.asnumpy() for o in out) if isinstance(out, tuple) else out.asnumpy()


# ---- 1. contracts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,atol", [(np.float32, 1e-5), (np.float16, 2e-2)])
def test_rms_norm_and_swiglu_follow_their_formulas(dtype, atol):
    rng = np.random.default_rng(0)
    x, gamma = rng.normal(size=(5, 64)).astype(dtype), rng.normal(size=64).astype(dtype)
    y, rstd = run(RmsNormRef(1e-5), x, gamma)
    want_y, want_rstd = contract.rms_norm(x, gamma, 1e-5)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, want_y, atol=atol, rtol=atol)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)
    gate_up = rng.normal(size=(5, 2 * 24)).astype(dtype)
    np.testing.assert_allclose(run(SwigluRef(), gate_up), contract.swiglu(gate_up), atol=atol, rtol=atol)


def test_rope_rotates_every_head_by_its_tokens_cos_sin_row():
    rng = np.random.default_rng(1)
    config = LlamaConfig(vocab_size=8, hidden_size=HEADS * HEAD_DIM, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    cos, sin = rotary_tables(config, 64)
    positions = np.array([0, 1, 2, 40, 0, 7, 63])  # two sequences back to back, and a decode position
    q = rng.normal(size=(7, HEADS * HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(7, KV_HEADS * HEAD_DIM)).astype(np.float32)
    got_q, got_k = run(RopeRef(HEAD_DIM), q, k, cos[positions], sin[positions], np.array([3, 4], np.int32))
    np.testing.assert_allclose(got_q, contract.rope(q, cos[positions], sin[positions], HEAD_DIM), atol=1e-5)
    np.testing.assert_allclose(got_k, contract.rope(k, cos[positions], sin[positions], HEAD_DIM), atol=1e-5)


class CacheWrite(nn.Cell):
    """ReshapeAndCache's stand-in writing into caches held as Parameters, as the attention cell holds them."""

    def __init__(self, key_cache: np.ndarray, value_cache: np.ndarray) -> None:
        super().__init__()
        self.key_cache = Parameter(Tensor(key_cache), name="key_cache")
        self.value_cache = Parameter(Tensor(value_cache), name="value_cache")
        self.write = ReshapeAndCacheRef()

    def construct(self, key, value, slot_mapping):
        return self.write(key, value, self.key_cache, self.value_cache, slot_mapping)


def test_reshape_and_cache_writes_each_token_at_its_slot_and_padding_only_to_the_dummy_block():
    rng = np.random.default_rng(2)
    blocks, block_size = 6, 4
    caches = [rng.normal(size=(blocks, block_size, KV_HEADS, HEAD_DIM)).astype(np.float16) for _ in range(2)]
    slots = np.array([5, 6, 7, 8, 21, 22, 0, 0, 0], np.int32)  # two prompts (blocks 1-2 and 5), 3 padding tokens
    key, value = (rng.normal(size=(9, KV_HEADS * HEAD_DIM)).astype(np.float16) for _ in range(2))
    cell = CacheWrite(*caches)
    returned = run(cell, key, value, slots)
    want_k, want_v = contract.reshape_and_cache(key, value, *caches, slots)
    got_k, got_v = cell.key_cache.asnumpy(), cell.value_cache.asnumpy()
    np.testing.assert_array_equal(returned, key)  # the output the backend makes the query depend on
    np.testing.assert_array_equal(got_k[1:], want_k[1:])  # block 0: padding writes, in an unspecified order
    np.testing.assert_array_equal(got_v[1:], want_v[1:])
    np.testing.assert_array_equal(got_k[3:5], caches[0][3:5])  # untouched blocks
    flat = got_k.reshape(blocks * block_size, KV_HEADS * HEAD_DIM)
    np.testing.assert_array_equal(flat[slots[:6]], key[:6])  # a slot is block * block_size + offset


@pytest.mark.parametrize("dtype,atol", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_paged_attention_reads_each_context_through_its_block_table_with_gqa(dtype, atol):
    rng = np.random.default_rng(3)
    blocks, block_size, width = 12, 4, 4
    key_cache, value_cache = (rng.normal(size=(blocks, block_size, KV_HEADS, HEAD_DIM)).astype(dtype)
                              for _ in range(2))
    context_lens = np.array([1, 4, 5, 16, 9], np.int32)  # one token, a full block, one more, the whole table
    tables = rng.integers(1, blocks, size=(5, width)).astype(np.int32)  # entries past a context: other blocks
    tables[3] = [7, 2, 9, 4]  # scattered, out of order
    query = rng.normal(size=(5, HEADS, HEAD_DIM)).astype(dtype)
    scale = HEAD_DIM ** -0.5
    paged = PagedAttentionRef(HEADS, scale, KV_HEADS)
    got = run(paged, query, key_cache, value_cache, tables, context_lens)
    assert got.dtype == dtype and got.shape == (5, HEADS, HEAD_DIM)
    want = contract.paged_attention(query, key_cache, value_cache, tables, context_lens, scale)
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)
    garbage = tables.copy()
    garbage[0, 1:] = garbage[2, 2:] = 0  # what lies past a context does not matter
    again = run(paged, query, key_cache, value_cache, garbage, context_lens)
    np.testing.assert_array_equal(again, got)


def test_paged_attention_takes_several_queries_per_sequence_with_q_seq_lens():
    """Chunks and prefix-cache hits: each sequence's queries are the last of its context, masked past their
    positions (the mask rows as AscendAttention.chunked builds them)."""
    rng = np.random.default_rng(6)
    blocks, block_size, width = 12, 4, 4
    key_cache, value_cache = (rng.normal(size=(blocks, block_size, KV_HEADS, HEAD_DIM)).astype(np.float16)
                              for _ in range(2))
    q_lens, context_lens = np.array([3, 1, 5], np.int32), np.array([9, 4, 5], np.int32)  # a chunk, a decode, a prompt
    tables = rng.integers(1, blocks, size=(3, width)).astype(np.int32)
    positions = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, context_lens)])
    mask = (np.arange(width * block_size)[None, :] > positions[:, None]) * -10000.0
    query = rng.normal(size=(q_lens.sum(), HEADS, HEAD_DIM)).astype(np.float16)
    scale = HEAD_DIM ** -0.5
    paged = PagedAttentionRef(HEADS, scale, KV_HEADS)
    got = run(paged, query, key_cache, value_cache, tables, context_lens, None, None, mask.astype(np.float16), q_lens)
    want = contract.paged_attention_queries(query, key_cache, value_cache, tables, context_lens, q_lens, mask, scale)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)
    decode = run(paged, query[3:4], key_cache, value_cache, tables[1:2], context_lens[1:2])  # the same row alone
    np.testing.assert_allclose(got[3:4], decode, atol=1e-3)
    for bad_q, bad_ctx in (([3, 0, 5], [9, 4, 5]), ([3, 1, 5], [2, 4, 5]), ([3, 1, 4], [9, 4, 5])):
        out = run(paged, query, key_cache, value_cache, tables, np.array(bad_ctx, np.int32), None, None,
                  mask.astype(np.float16), np.array(bad_q, np.int32))
        assert np.isnan(out).all(), (bad_q, bad_ctx)  # empty, longer than its context, short of the rows


CAUSAL = np.triu(np.ones((128, 128)), 1) * -10000.0  # float16's (and float32's) values; bfloat16's are 0/1


@pytest.mark.parametrize("q_lens,kv_lens", [((5, 7, 1, 3), (5, 7, 1, 3)), ((2, 3), (4, 3))],
                         ids=["prefill", "bottom-right"])
def test_flash_attention_th_is_causal_within_each_sequence_of_its_lengths(q_lens, kv_lens):
    rng = np.random.default_rng(4)
    q_lens, kv_lens = np.array(q_lens, np.int32), np.array(kv_lens, np.int32)
    q = rng.normal(size=(q_lens.sum(), HEADS * HEAD_DIM)).astype(np.float16)
    k, v = (rng.normal(size=(kv_lens.sum(), KV_HEADS * HEAD_DIM)).astype(np.float16) for _ in range(2))
    scale = HEAD_DIM ** -0.5
    mask = CAUSAL.astype(np.float16)
    out = run(FlashAttentionThRef(HEADS, scale), q, k, v, None, None, None, mask, None, q_lens, kv_lens)[3]
    want = contract.flash_attention_th(q, k, v, mask, "float16", q_lens, kv_lens, HEADS, scale)
    np.testing.assert_allclose(out, want, atol=2e-3, rtol=2e-3)


def test_stand_ins_answer_nan_outside_the_kernels_preconditions():
    """So that a wiring mistake (an empty TH sequence, lengths not covering the rows passed, cumulative lengths,
    another mask, an empty decode context) fails the tests below instead of passing on a plausible answer."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(8, HEADS * HEAD_DIM)).astype(np.float16)
    k = rng.normal(size=(8, KV_HEADS * HEAD_DIM)).astype(np.float16)
    flash = FlashAttentionThRef(HEADS, 0.25)
    mask = CAUSAL.astype(np.float16)
    assert not np.isnan(run(flash, q, k, k, None, None, None, mask, None, *[np.array([3, 5], np.int32)] * 2)[3]).any()
    for lengths in ([3, 0, 5], [3, 3, 1], [3, 6, 8]):  # empty, short of the rows, cumulative
        lens = np.array(lengths, np.int32)
        assert np.isnan(run(flash, q, k, k, None, None, None, mask, None, lens, lens)[3]).all()
    for other in (np.triu(np.ones((128, 128)), 1), CAUSAL.T, np.triu(np.ones((128, 128)), 0) * -10000.0):
        lens = np.array([3, 5], np.int32)
        assert np.isnan(run(flash, q, k, k, None, None, None, other.astype(np.float16), None, lens, lens)[3]).all()
    caches = [rng.normal(size=(4, 4, KV_HEADS, HEAD_DIM)).astype(np.float16) for _ in range(2)]
    out = run(PagedAttentionRef(HEADS, 0.25, KV_HEADS), q[:2].reshape(2, HEADS, HEAD_DIM), *caches,
              np.array([[1, 2], [3, 1]], np.int32), np.array([0, 5], np.int32))
    assert np.isnan(out[0]).all() and not np.isnan(out[1]).any()


def test_argmax_with_value_takes_the_first_maximum():
    logits = np.array([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0], [-2.0, -3.0, -1.5, -9.0]], np.float32)
    index, top = run(ReferenceOps(HEAD_DIM).argmax_with_value(), logits)
    want_index, want_top = contract.argmax_with_value(logits)
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_array_equal(top, want_top)


# ---- 2. the wiring against Hugging Face ------------------------------------------------------------------
PROMPT_LENS = (5, 9, 17, 3, 30, 12, 7, 21)
STEPS = 16


@pytest.fixture(scope="module", params=["float32", "float16"])
def wired(request, tmp_path_factory):
    """The Ascend backend's graphs with the CPU stand-ins, and Hugging Face in the same dtype."""
    dtype = request.param
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # head_dim 64
    model_dir = build_random_model(tmp_path_factory.mktemp("llama"), config, seed=7, std=0.2)
    rc = RunnerConfig(num_blocks=40, block_size=16, max_model_len=64, prefill_batch_sizes=(3,),
                      prefill_seq_lengths=(32,), decode_batch_sizes=(8,), decode_block_widths=(4,), dtype=dtype)
    runner = ModelRunner(config, load_weights(model_dir, config), rc, AscendBackend(ReferenceOps(config.head_dim)))
    runner.warmup()
    hf = load_hf(model_dir)
    return config, runner, hf.half() if dtype == "float16" else hf


def prompts(config: LlamaConfig, lens, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[config.bos_token_id] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in lens]


def check_against_hf(runner, hf, batch_prompts, steps) -> int:
    """The module doc's rule for each prompt; returns how many prompts had identical ids."""
    tokens, logprobs = PagedDriver(runner, seed=1).generate(batch_prompts, steps)
    if runner.rc.dtype == "float32":
        for prompt, got, got_lp in zip(batch_prompts, tokens, logprobs):
            ref, ref_lp = hf_greedy(hf, prompt, steps)
            assert got == ref
            np.testing.assert_allclose(got_lp, ref_lp, atol=1e-4)
        return len(batch_prompts)
    return sum(check_greedy_near(hf, prompt, got, got_lp, FP16_TIE, FP16_LOGPROB)
               for prompt, got, got_lp in zip(batch_prompts, tokens, logprobs))


def test_greedy_matches_hugging_face(wired):
    """Ragged prefill calls of up to three prompts (the last sequence absorbing the bucket's padding), decode
    batches of eight rows."""
    config, runner, hf = wired
    assert check_against_hf(runner, hf, prompts(config, PROMPT_LENS), STEPS) >= len(PROMPT_LENS) - 2


def test_prompts_filling_their_bucket_leave_the_padding_sequence_only_the_appended_rows(wired):
    """A lone 32- or 48-token prompt fills its token bucket: the two empty sequences get one of the rows appended
    in the graph each, so every TH length stays positive (the stand-in answers NaN otherwise); the decode bucket
    of eight has seven padding rows (context length 1), which attend over the dummy slot."""
    config, runner, hf = wired
    backend = runner.backend
    assert backend.ragged_lengths(np.array([32, 0, 0], np.int32), 32).tolist() == [32, 1, 2]
    assert backend.ragged_lengths(np.array([5, 9, 0], np.int32), 16).tolist() == [5, 9, 5]
    assert backend.ragged_lengths(np.array([5, 9, 2], np.int32), 16).tolist() == [5, 9, 5]
    for n in (32, 48):
        (prompt,) = prompts(config, (n,), seed=n)
        assert runner.plan(contiguous_prefill([prompt], runner.rc.block_size))[0].tolist() == [0]
        check_against_hf(runner, hf, [prompt], 4)


def test_cache_has_the_block_layout_and_the_logits_output_is_kept(wired):
    config, runner, hf = wired
    for cache in runner.model.layers[0].attention.caches():
        assert tuple(cache.shape) == (40, 16, config.num_key_value_heads, config.head_dim)
    batch_prompts = prompts(config, (6, 11), seed=3)
    logits = runner.step_logits(contiguous_prefill(batch_prompts, runner.rc.block_size))
    assert logits.dtype == np.float32 and logits.shape == (2, config.vocab_size)
    atol = 1e-4 if runner.rc.dtype == "float32" else FP16_TIE
    for row, prompt in zip(logits, batch_prompts):
        np.testing.assert_allclose(row, hf_last_logits(hf, prompt).float().numpy(), atol=atol)


# ---- 3. the numpy references alone, as a whole model -------------------------------------------------------------
def numpy_llama_generate(weights: dict, config: LlamaConfig, prompts: list[list[int]], steps: int,
                         block_size: int = 16) -> list[list[int]]:
    """Greedy generation with nothing but the numpy references (agents/tools/preflight/references.py): both
    prompts in one ``TH`` prefill (per-sequence lengths, the causal mask), their K/V written into block caches,
    then decode steps through PagedAttention's block tables. Independent of our graphs, so it checks the references
    themselves against Hugging Face."""
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden, kv_dim, scale = config.hidden_size, config.kv_dim, d ** -0.5
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d)

    def tables(positions):
        angles = np.outer(positions, inv_freq)
        return np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))

    blocks = [[1 + 8 * b + j for j in range(8)] for b in range(len(prompts))]  # 8 blocks each, block 0 unused
    caches = [[np.zeros((1 + 8 * len(prompts), block_size, kv_heads, d)) for _ in range(2)]
              for _ in range(config.num_hidden_layers)]
    sequences = [list(p) for p in prompts]

    def forward(ids, positions, lens, prefill):
        x = weights["embed_tokens"][ids].astype(np.float64)
        cos, sin = tables(positions)
        slots = np.array([blocks[b][p // block_size] * block_size + p % block_size
                          for b, n in enumerate(lens) for p in positions[sum(lens[:b]): sum(lens[:b]) + n]])
        for i in range(config.num_hidden_layers):
            w = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
            qkv = contract.rms_norm(x, w["attention_norm"], config.rms_norm_eps)[0] @ w["w_qkv"].T
            q, k, v = qkv[:, :hidden], qkv[:, hidden:hidden + kv_dim], qkv[:, hidden + kv_dim:]
            q, k = contract.rope(q, cos, sin, d), contract.rope(k, cos, sin, d)
            caches[i] = list(contract.reshape_and_cache(k, v, *caches[i], slots))
            if prefill:
                lengths = np.array(lens)
                attn = contract.flash_attention_th(q, k, v, CAUSAL, "float16", lengths, lengths, heads, scale)
            else:
                context = np.array([len(s) for s in sequences])
                attn = contract.paged_attention(q.reshape(-1, heads, d), *caches[i], np.array(blocks), context,
                                                scale).reshape(-1, hidden)
            x = x + attn @ w["wo"].T
            x = x + contract.swiglu(contract.rms_norm(x, w["ffn_norm"], config.rms_norm_eps)[0]
                                    @ w["w_gate_up"].T) @ w["w_down"].T
        last = np.cumsum(lens) - 1
        logits = contract.rms_norm(x[last], weights["norm"], config.rms_norm_eps)[0] @ weights["lm_head"].T
        return contract.argmax_with_value(logits)[0]

    lens = [len(p) for p in prompts]
    positions = np.concatenate([np.arange(n) for n in lens])
    out = [[int(t)] for t in forward(np.concatenate(prompts), positions, lens, True)]
    for _ in range(steps - 1):
        for seq, o in zip(sequences, out):
            seq.append(o[-1])
        ids = np.array([s[-1] for s in sequences])
        nxt = forward(ids, np.array([len(s) - 1 for s in sequences]), [1] * len(sequences), False)
        for o, t in zip(out, nxt):
            o.append(int(t))
    return out


def test_the_numpy_references_alone_compute_llama_as_hugging_face(tmp_path):
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # head_dim 64
    model_dir = build_random_model(tmp_path, config, seed=11, std=0.2)
    weights = load_weights(model_dir, config)
    batch_prompts = prompts(config, (6, 11), seed=4)
    got = numpy_llama_generate(weights, config, batch_prompts, 5)
    hf = load_hf(model_dir)
    assert got == [hf_greedy(hf, p, 5)[0] for p in batch_prompts]
