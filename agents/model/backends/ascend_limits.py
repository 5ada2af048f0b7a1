"""What MindSpore 2.10's internal Ascend kernels (``infer_boost`` on) accept, read from their error strings in
``lib/plugin/ascend/ms_kernels_internal/internal_kernel/lib/libms_kernels_internal.so`` and from the primitives'
docs. MindSpore's export checks none of them: the backend refuses a model or cache outside them at load
(``agents.model.backends.ascend.model_problems``) and the contract checker refuses a graph (``agents.tools.contracts``).
"""

PA_BLOCK_SIZES = (16, 32, 64, 128)  # "table block size can only in {16,32,64,128}"
PA_MAX_HEAD_DIM_X_BLOCK = 16384  # "head_dim * table_block_size > 16384 is not supported"
MAX_HEAD_DIM = 256  # "PA: 'head_dim' must be less than or equal to 256 when is not MLA mode" (FA: the same)
HEAD_DIM_MULTIPLE = 16  # "PA: 'head_dim' must be an integer multiple of 16" (FA: the same)
FA_CAUSAL_HEAD_DIMS = (64, 128, 256)  # "lower triangle mode can only support head_dim = (64, 128, 256)"
MAX_HEADS = 256  # FlashAttentionScore doc: N1 in 1..256
MAX_TH_BATCH = 1024  # FlashAttentionScore doc: TND/TH take at most 1024 sequences

# FlashAttention's causal mask on the internal path (sparse_mode 0): 128 x 128, 0 on and below the diagonal and,
# above it, 1 in bfloat16 or -10000 in float16 ("FA: normal: mask BF16(0/1), FP16 mask(0/-10000)": vllm-mindspore
# model_executor/models/attention_mask.py; MindFormers 1.8 LowerTriangularMaskWithDynamic builds the same)
FA_MASK_SIZE = 128


def fa_mask_value(dtype: str) -> float:
    """The masked entries' value of FlashAttention's causal mask in ``dtype`` (``"bfloat16"``, ``"float16"``)."""
    return 1.0 if dtype == "bfloat16" else -10000.0


# PagedAttention's mask with multi-token queries (q_seq_lens): a row per query token, 0 up to its position and
# -10000 past it, in bfloat16 as in float16 ("normal + Q_seqlen > 1: BF16 mask(0/-10000), FP16 mask(0/-10000)":
# vllm-mindspore model_executor/models/attention_mask.py, whose decode_mask rows are gathered by position)
CHUNK_MASK_VALUE = -10000.0

# WeightQuantBatchMatmul (w8a16) on Atlas A2 / 910B, CANN's aclnnWeightQuantBatchMatmulV2 doc (hicann ops-nn,
# matmul/weight_quant_batch_matmul_v2/docs): "k and n in [1, 65535]" (so a large vocabulary's lm_head stays float)
WQ_MAX_DIM = 65535
