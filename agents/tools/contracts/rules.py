"""Every rule with where it was read, and the checks the exporters run (``export --check``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from agents.model.backends.ascend_limits import (
    WQ_MAX_DIM,
)
from agents.tools.contracts.base import (
    DEFAULT_PA_KERNEL,
    KV_LENGTHS_INPUT,
    PA_KERNELS,
    Q_LENGTHS_INPUT,
    Expect,
    Rule,
    Violation,
)
from agents.tools.contracts.moe_ops import (
    _dropless,
    _gating,
    _grouped_mode,
    _grouped_weights,
    _routing_ids,
    _unpermute,
)
from agents.tools.contracts.other_ops import (
    WORLD_GROUP,
    _collective_group,
    _fa_heads_and_scale,
    _fa_lengths,
    _fa_mask_and_sparse_mode,
    _fa_roped,
    _rc_int8,
    _rc_layout,
    _rc_roped,
    _rc_slots,
    _rope_format,
    _rope_tables,
    _wq_limits,
    _wq_plain,
    _wq_scale,
    _wq_weight,
)
from agents.tools.contracts.paged_attention import (
    _pa_heads,
    _pa_int8_cache,
    _pa_int32,
    _pa_lengths_from_graph_input,
    _pa_limits,
    _pa_mask_values,
    _pa_mask_width,
    _pa_plain_attention,
    _pa_queries,
    _pa_reads_what_was_written,
    _pa_roped_query,
    _pa_scale,
)
from agents.tools.mindir import GraphNodes, read_graph
from llm_serving.protocol.ascend_env import ascend_environment, paged_attention_kernel

_INTERNAL_LIB = "MindSpore 2.10 lib/plugin/ascend/ms_kernels_internal/internal_kernel/lib/libms_kernels_internal.so"
_ROPE_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/apply_rotary_pos_emb.cc"
_STACKS_ROPE = ("MindFormers 1.8 modules/infer_rotary_embedding (exported graphs in tests_mindformers) and "
                "vllm-mindspore model_executor/layers/rotary_embedding.py (InferRotaryEmbedding, MRotaryEmbedding)")
_PA_DOC = "mindspore.ops.auto_generate.PagedAttention (2.10 docstring)"
_PA_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/paged_attention.cc"
_RC_DOC = "mindspore.ops.auto_generate.reshape_and_cache (2.10 docstring)"
_FA_KERNEL = "MindSpore 2.10 ops/kernel/ascend/internal/flash_attention_score.cc"
_MF_ATTENTION = "MindFormers 1.8 modules/infer_attention.py, whose exported prefill graphs pass it (tests_mindformers)"
_WQ_DOC = ("CANN aclnnWeightQuantBatchMatmulV2 (hicann ops-nn matmul/weight_quant_batch_matmul_v2/docs), the kernel "
           "MindSpore 2.10 runs it with (ops/kernel/ascend/aclnn/kernel_mod_impl/customize/"
           "weight_quant_batch_matmul_aclnn_kernel.h; no internal kernel)")
_WQ_STACKS = ("Golden Stick ptq/ptq/hal.py WeightQuantMatmul: WeightQuantBatchMatmul(False, linear.transpose_b, "
              "group_size) on the int8 weight [out, in]; MindFormers r1.7 quantization/golden_stick: "
              "WeightQuantBatchMatmul(False, True, group_size), offset None")
_GATING_DOC = "mindspore.ops.auto_generate.MoeGatingTopKSoftmax (2.10 docstring)"
_ROUTING_DOC = "mindspore.ops.auto_generate.MoeInitRoutingV2 (2.10 docstring)"
_GMM_DOC = "mindspore.ops.grouped_matmul_v4 (2.10 docstring)"
_UNPERMUTE_DOC = "mindspore.ops.moe_token_unpermute (2.10 docstring)"
_VMS_MOE = "vllm-mindspore 0.5.1 model_executor/layers/fused_moe/fused_moe.py"
RULES = (
    Rule("PagedAttention", "lengths-from-graph-input",
         f"{_PA_KERNEL}: CreateKernel/UpdateParam take kv_seq_len from GetSeqLenFromGraphAndCheckUpadate("
         f"{{\"{KV_LENGTHS_INPUT}\"}}), i.e. LLMManager's copy of the graph input of that name",
         _pa_lengths_from_graph_input),
    Rule("PagedAttention", "multi-token-queries",
         f"{_PA_KERNEL} (q_seq_len from GetSeqLenFromGraphAndCheckUpadate({{\"{Q_LENGTHS_INPUT}\"}})); vllm-mindspore "
         "attention/layer.py and models/attention_mask.py: chunks and prefix-cache hits pass q_seq_lens with a mask "
         "row per query token in the compute dtype (decode_mask rows gathered by position; ATB: \"mask data type "
         "not consitent with q\" in libatb_mixops_ms.so), decode no mask",
         _pa_queries),
    Rule("PagedAttention", "chunk-mask-width",
         f"both kernels read row i's scores against mask[i, :context_len], so a row spans every position the table "
         f"reaches (table width x block_size); custom only: {_INTERNAL_LIB} refuses a wider mask (\"max kv_seq_len of "
         "key cache is smaller than mask's kv length\"): width <= reach, not >=", _pa_mask_width),
    Rule("PagedAttention", "chunk-mask-values-and-direction",
         "the mask's producer traced (constant rows, or Cast(kv_position > query_position) * -10000): vllm-mindspore "
         "models/attention_mask.py (\"normal + Q_seqlen > 1: BF16 mask(0/-10000), FP16 mask(0/-10000)\"), 0 up to "
         "each query's own position, -10000 after it (both kernels add it to the scores)", _pa_mask_values),
    Rule("PagedAttention", "plain-attention-mode",
         "MindSpore 2.10 internal_kernel/include/op_param.h:214-218 (MaskType kMaskTypeAlibi, MaskMode "
         f"kTrapezoidalMask) and {_PA_DOC} (\"No need to pass a real mask tensor if TRAPEZOIDAL is set\"; "
         "mla_v_dim for MLA): Llama passes no alibi_mask, MASK_DEFAULT, mla_v_dim 0", _pa_plain_attention),
    Rule("PagedAttention", "int32-tables-and-lengths",
         f"{_PA_DOC}: block_tables and context_lens int32; internal_kernel_utils.cc reads the lengths as int32_t",
         _pa_int32),
    Rule("PagedAttention", "head-counts-and-layout",
         f"{_PA_DOC}: query (num_tokens, num_head, head_dim), caches (num_blocks, block_size, num_head, "
         f"head_dim); MindFormers 1.8's decode passes the query as (batch, 1, num_head * head_dim); {_PA_KERNEL}: "
         "head_num and kv_head_num read from inputs 10 and 12; a 2-D query (tokens, num_head * head_dim) only on "
         "the ATB kernel: MindSpore 2.10 lib/plugin/ascend/ms_kernels_internal/asdops/lib/libatb_mixops_ms.so, its "
         "strings beside \"check pageattention param fail\": \"Input0 dim num ... invalid, should be 2 or 3\", "
         "\"param kvHead must equal key_cache dim2\", \"... key_cache ... must be [numBlocks, blockSize, numHeads, "
         "headSize]\"; the custom kernel's docstring layout is 3-D", _pa_heads),
    Rule("PagedAttention", "scale", "the Llama attention: scores scaled by 1/sqrt(head_dim)", _pa_scale),
    Rule("PagedAttention", "kernel-limits",
         f"{_INTERNAL_LIB}, its error strings: \"table block size can only in {{16,32,64,128}}\", \"head_dim * "
         "table_block_size > 16384 is not supported\", \"PA: 'head_dim' must be an integer multiple of 16\", "
         "\"... less than or equal to 256 when is not MLA mode\"", _pa_limits),
    Rule("PagedAttention", "roped-query",
         "the Llama attention: queries are roped before attending (MindFormers 1.8 and vllm-mindspore pass "
         "ApplyRotaryPosEmb's output 0)", _pa_roped_query),
    Rule("PagedAttention", "int8-cache-antiquant",
         "MindSpore 2.10 ops_func_impl/paged_attention.cc InferType: int8 key/value caches only with infer_boost, "
         "antiquant scale/offset pairs (float16, float16), (int64, int32) or (float32, int32); "
         f"{_PA_DOC}: (2, num_head * head_dim) for kv_cache_quant_mode DEFAULT; vllm-mindspore "
         "quantization/kv_cache.py KVCacheInt8Method and Golden Stick's paged-attention deploy cell: kv_scale and "
         "kv_offset Parameters (2, kv_heads * head_dim) float16, row 0 keys, row 1 values", _pa_int8_cache),
    Rule("PagedAttention", "reads-the-written-caches",
         "the paged cache: PagedAttention must read, as key and value, the Parameters ReshapeAndCache wrote",
         _pa_reads_what_was_written),
    Rule("FlashAttentionScore", "per-sequence-lengths",
         f"{_FA_KERNEL}: UpdateSeqLen takes q_seq_len/kv_seq_len from inputs 8 and 9 as tuples (else from the graph "
         f"inputs batch_valid_length/actual_seq_kvlen, q_seq_lens/actual_seq_qlen): one length per sequence; "
         f"{_MF_ATTENTION}: batch_valid_length", _fa_lengths),
    Rule("FlashAttentionScore", "mask-and-sparse-mode",
         f"{_FA_KERNEL} (sparse_mode, mask dtype and dims handed to the kernel); {_MF_ATTENTION}: sparse_mode 0 "
         "with a 128 x 128 causal mask in the compute dtype; its values, 0/1 in bfloat16 and 0/-10000 in "
         "float16: vllm-mindspore model_executor/models/attention_mask.py (\"FA: normal: mask BF16(0/1), FP16 "
         "mask(0/-10000)\") and MindFormers 1.8 LowerTriangularMaskWithDynamic", _fa_mask_and_sparse_mode),
    Rule("FlashAttentionScore", "heads-scale-and-head-dim",
         f"{_FA_KERNEL}: head_num and scale_value read from inputs 10 and 12; layout TH: query (T, head_num * "
         "head_dim) (no head_dim limit here: the custom kernel's \"lower triangle mode can only support head_dim = "
         "(64, 128, 256)\" is for its BSH/BNSD layouts, not the TH this graph passes)",
         _fa_heads_and_scale),
    Rule("FlashAttentionScore", "roped-query-and-key",
         "the Llama attention: query and key roped (ApplyRotaryPosEmb's outputs 0 and 1), the value not",
         _fa_roped),
    Rule("ApplyRotaryPosEmb", "cos-format",
         f"{_ROPE_KERNEL}: cos_format read from input 5; {_STACKS_ROPE}: ApplyRotaryPosEmb(2) for Llama's "
         "rotate-half layout with cos/sin rows of head_dim values (the halves repeated)", _rope_format),
    Rule("ApplyRotaryPosEmb", "tables-and-positions",
         f"{_ROPE_KERNEL}: query, key, cos, sin, position_ids passed to the kernel as inputs 0-4; {_STACKS_ROPE}: "
         "cos/sin (rows, head_dim), one row per token gathered at its position or the whole table with "
         "batch_valid_length as position_ids (prefill in both), query and key (..., heads * head_dim)", _rope_tables),
    Rule("ReshapeAndCache", "caches-the-roped-key",
         "the paged cache holds keys after the rotary embedding (PagedAttention does not rope them again) and "
         "values without it: MindFormers 1.8's graphs write ApplyRotaryPosEmb's output 1 and the raw value",
         _rc_roped),
    Rule("WeightQuantBatchMatmul", "int8-weight-out-by-in",
         f"{_WQ_STACKS}; MindSpore 2.10 ops_func_impl/weight_quant_batch_matmul.cc: transpose_weight reads the weight "
         "as (n, k), x's last dim must be its k", _wq_weight),
    Rule("WeightQuantBatchMatmul", "per-channel-scale",
         f"{_WQ_DOC}: per-channel antiquantScale (n,) or (1, n) with antiquantGroupSize 0, in x's dtype "
         "(weight_quant_batch_matmul.cc checks only the dtype)", _wq_scale),
    Rule("WeightQuantBatchMatmul", "no-offset-bias-or-output-quantization",
         f"{_WQ_DOC}: y = x @ ((w + offset) * scale) + bias, int8 y with quant_scale; on A2 a bfloat16 x wants a "
         f"float32 bias; {_WQ_STACKS} pass no bias", _wq_plain),
    Rule("WeightQuantBatchMatmul", "quant-matmul-limits",
         f"{_WQ_DOC}, A2/A3: x 2-D (m, k) float16 or bfloat16, k and n in [1, {WQ_MAX_DIM}]", _wq_limits),
    Rule("AllReduce", "world-group-collectives",
         "MindSpore 2.10 communication/management.py: init() on Ascend creates HCCL's world group "
         f"{WORLD_GROUP!r} (GlobalComm.WORLD_COMM_GROUP); agents/model/parallel.py: partial sums all-reduced, the "
         "greedy pick's candidates all-gathered from every rank", _collective_group),
    Rule("AllGather", "world-group-collectives-gather", "as world-group-collectives; AllGather's rank_size shapes "
         "its output (ops.AllGather reads it from the group joined)", _collective_group),
    Rule("ReshapeAndCache", "int8-cache-quantized",
         f"{_RC_DOC}: key/value and caches of one dtype (the op copies); vllm-mindspore KVCacheInt8Method "
         "quantizes K and V to int8 before it (QuantV2 ROUND; we round, clamp and cast, docs/quantization.md)",
         _rc_int8),
    Rule("ReshapeAndCache", "int32-slots", f"{_RC_DOC}: slot_mapping int32 (num_tokens,); the tokens are the key's "
         "rows however it is shaped (MindFormers 1.8 passes (1, tokens, kv_heads * head_dim) in prefill)", _rc_slots),
    Rule("ReshapeAndCache", "cache-layout",
         f"{_RC_DOC}: caches (num_blocks, block_size, num_head, head_dim), key/value (num_tokens, num_head, "
         "head_dim) or, as MindFormers passes them, (..., num_head * head_dim)", _rc_layout),
    Rule("MoeGatingTopKSoftmax", "gating-logits-and-k",
         f"{_GATING_DOC}: x 2-D or 3-D float16/bfloat16/float32, 0 <= k <= x's last dim, finished optional; "
         f"{_VMS_MOE} fused_topk: (router_logits, None, top_k)", _gating),
    Rule("MoeInitRoutingV2", "dropless-routing",
         f"{_ROUTING_DOC}: drop_pad_mode 0 with active_num 0 is the dropless scenario, expert_capacity only for "
         f"Drop/Pad, the counts output valid only with expert_tokens_count_or_cumsum_flag 1 (cumsum) or 2 (counts); "
         f"{_VMS_MOE} run_tp: (x, ids, 0, 0, experts, 0, 2, True)", _dropless),
    Rule("MoeInitRoutingV2", "expert-ids-from-gating",
         f"{_ROUTING_DOC}: expert_idx (NUM_ROWS, K) int32, the experts of each row; {_GATING_DOC}: output 1 "
         "expert_idx (the expert ids), output 2 row_idx (original row positions)", _routing_ids),
    Rule("GroupedMatmulV4", "row-groups-from-routing",
         f"{_GMM_DOC}: split_item 0 or 3 (3: a single tensor), group_type 0 (the m axis), group_list int64, "
         f"group_list_type 0 (cumsum) or 1 (sizes); {_ROUTING_DOC}: flag 1 cumulative, 2 counts, output 2; "
         f"{_VMS_MOE} _group_matmul: split_item 3, group_type 0, group_list_type 1 with flag 2", _grouped_mode),
    Rule("GroupedMatmulV4", "experts-in-by-out",
         f"{_GMM_DOC}: x (M, K), weight (E, K, N), y_i = x_i x weight_i; bias/scale/offset/antiquant for biased or "
         "quantized experts only (A16W8: weight int8, antiquant_scale (E, N) float16 or bfloat16, x's dtype); "
         f"{_VMS_MOE}: w1 (experts, hidden, 2 x intermediate), w2 (experts, intermediate, hidden)", _grouped_weights),
    Rule("InnerMoeTokenUnpermute", "unpermute-by-routing-index",
         f"{_UNPERMUTE_DOC}: permuted_tokens (tokens x topk, hidden), sorted_indices (tokens x topk,) int32 with no "
         "duplicates, probs (tokens, topk), padded_mode False; ops.moe_token_permute's example: sorted_indices[i] "
         f"is where row i went (MoeInitRoutingV2's expanded_row_idx); {_VMS_MOE}: moe_token_unpermute(expert_output, "
         "unsort_map, topk_weights, False, None)", _unpermute),
)


def check_graph(graph: GraphNodes, rules: tuple[Rule, ...] = RULES, tensor_parallel: int = 1,
                paged_attention: str = DEFAULT_PA_KERNEL) -> list[Violation]:
    """Every rule on every node of its op, in graph order; ``tensor_parallel``: the ranks the graph is one of;
    ``paged_attention``: the PagedAttention kernel selected (``PA_KERNELS``)."""
    if paged_attention not in PA_KERNELS:
        raise ValueError(f"paged_attention must be one of {', '.join(PA_KERNELS)}, got {paged_attention!r}")
    expect = Expect(tensor_parallel, paged_attention)
    out = []
    for node in graph.nodes:
        for rule in rules:
            if rule.op == node.op:
                out += [Violation(node.op, node.name, rule.name, msg) for msg in rule.check(graph, node, expect)]
    return out


def add_check_argument(parser: argparse.ArgumentParser) -> None:
    """``--check`` of both exporters (ours and the mindformers backend's)."""
    parser.add_argument("--check", action="store_true", help="check every exported graph against the fused ops' "
                        "contracts (agents.tools.contracts); exit 1 on a violation")
    parser.add_argument("--paged-attention-kernel", choices=PA_KERNELS, default=None,
                        help="the PagedAttention kernel the check assumes runs: atb (custom kernel named in "
                        "MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST) or custom; default: the one the config's agent "
                        "environment selects (model_config.ascend_disable_custom_kernels; the stacks': atb)")


def selected_paged_attention(chosen: str | None, runner_config: Mapping[str, Any]) -> str:
    """The kernel an export is checked against: ``chosen`` (``--paged-attention-kernel``), else the one the
    agents' environment selects (``device_environment``; the table's defaults where it has none, as on CPU)."""
    if chosen is not None:
        return chosen
    environment = runner_config.get("device_environment") or ascend_environment(1, {})
    return paged_attention_kernel(environment)


def check_exported(files: Iterable[Path], tensor_parallel: int = 1, paged_attention: str = DEFAULT_PA_KERNEL) -> int:
    """An exporter's exit status after ``--check``: 1 if any exported file breaks a rule (each printed), else 0."""
    return 1 if report(files, lambda line: print(line, flush=True), tensor_parallel, paged_attention) else 0


def report(paths: Iterable[Path], out: Callable[[str], None], tensor_parallel: int = 1,
           paged_attention: str = DEFAULT_PA_KERNEL) -> int:
    """``export --check``: check each MindIR file, write one line per violation (or that the file passed) and
    return how many violations there were."""
    total = 0
    for path in paths:
        found = check_graph(read_graph(path), tensor_parallel=tensor_parallel, paged_attention=paged_attention)
        total += len(found)
        out(f"check {path.name}: " + ("every contract rule holds" if not found else f"{len(found)} violation(s)"))
        for v in found:
            out(f"  {v}")
    return total
