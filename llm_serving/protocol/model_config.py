"""Llama-family architecture hyper-parameters (read from a Hugging Face ``config.json``) and the names of the
dtypes, kernel sets and devices an agent can run, which the master validates its configuration against."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_serving.protocol.config_errors import ModelConfigError

if TYPE_CHECKING:
    from llm_serving.protocol.moe_config import MoeSpec

# A JSON object as json.loads returns it (config.json, an AgentSpec field): its values are checked where read
JsonObject = dict[str, Any]


@dataclass(frozen=True)
class Family:
    """Where an architecture's layer differs from Llama's (one layer definition takes these switches)."""

    model_type: str  # config.json's model_type for the architecture
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2's, always; the output projection has none)
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotary embedding (Qwen3's)


# architecture -> its family. Mistral is Llama's layer (without a sliding window shorter than the context, which
# refuse_unserved_keys refuses); Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms (its attention_bias, which would
# add an output bias too, is refused). The MoE families (llm_serving.protocol.moe_config) are their dense
# sibling's attention with the expert block in the MLP's place
FAMILIES = {"LlamaForCausalLM": Family("llama"), "MistralForCausalLM": Family("mistral"),
            "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True), "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
            "Qwen2MoeForCausalLM": Family("qwen2_moe", qkv_bias=True),
            "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True), "MixtralForCausalLM": Family("mixtral")}
SUPPORTED_ARCHITECTURES = {arch: family.model_type for arch, family in FAMILIES.items()}
HF_SINGLE_FILE = "model.safetensors"  # a Hugging Face model directory's weights: one file,
HF_INDEX_FILE = "model.safetensors.index.json"  # or shards listed in this index
DTYPES = ("float32", "float16", "bfloat16")
KERNEL_CHOICES = ("auto", "native", "portable")  # CPU ops: native C++ where they build, portable graph ops
DEVICE_TARGETS = ("CPU", "Ascend")  # model_config.device_target
ASCEND_DTYPES = ("float16", "bfloat16")  # what the Ascend fused kernels take (PagedAttention refuses float32)
# rope_scaling types the rotary tables compute as transformers does (agents.model.rope), with the keys each needs
# (dynamic: transformers computes plain RoPE up to max_position_embeddings, the most a dynamic model is served)
ROPE_TYPES = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
              "yarn": ("original_max_position_embeddings",)}
# model_config.precision: exact (the dtype's own arithmetic); half / fast: the native CPU projections with float16
# weights (float32 arithmetic) / bfloat16 weights and inputs (float32 sums); docs/benchmarks.md "Fast precision mode"
PRECISIONS = ("exact", "fast", "half")
# model_config.quantization: none, or w8a16 (int8 weights of the decoder layers' projections, per output channel,
# float activations; agents.weights.packed "int8 weights"); docs/quantization.md
QUANTIZATIONS = ("none", "w8a16")
# model_config.kv_cache_dtype: auto (the model's dtype), or int8 (per token and kv head scales; native CPU kernels,
# agents/model/kernels/paged_attention.cc); docs/quantization.md
KV_CACHE_DTYPES = ("auto", "int8")
# an int8 KV cache on Ascend: each channel's static scale is this x its calibrated largest value / 127
# (agents.weights.kv_scales, `llm-serving calibrate-kv --headroom`; measured in docs/quantization.md)
KV_SCALE_HEADROOM = 1.25
# config.json quantization_config of a checkpoint with int8 weights: compressed-tensors' W8A16 (llm-compressor's
# output, vLLM's format, and `llm-serving quantize`'s), in either of its two layouts of the int8 values
# (agents/weights/int8_checkpoint.py); docs/quantization.md "Pre-quantized checkpoints"
INT8_CHECKPOINT_FORMATS = ("int-quantized", "pack-quantized")
INT8_CHECKPOINT_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    tie_word_embeddings: bool = False
    # {"rope_type": linear | llama3 | yarn, and its parameters}; None: plain RoPE (agents.model.rope)
    rope_scaling: JsonObject | None = None
    # every end-of-sequence id (config.json's and generation_config.json's lists; Llama 3 instruct: <|end_of_text|>,
    # <|eom_id|>, <|eot_id|>): any of them ends a sequence. Empty: eos_token_id alone
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"  # a FAMILIES key: where the layer differs from Llama's
    # config.json's head_dim where it is not hidden_size / num_attention_heads (Qwen3, Mistral Nemo); else None
    explicit_head_dim: int | None = None
    # the checkpoint holds the layers' projections as int8 with a scale per output channel (checkpoint_int8)
    int8_weights: bool = False
    # a mixture-of-experts model's routing (a MoeSpec; the dict asdict made of one, after an AgentSpec round trip)
    moe: MoeSpec | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def rope_position_limit(self) -> int | None:
        """The most positions this model is served for, where rope_scaling sets one (None: none). A ``dynamic``
        model's: max_position_embeddings, within which transformers' dynamic NTK keeps the plain frequencies; beyond
        it, it recomputes them for the whole sequence at its current length, which keys already in a KV cache cannot
        follow."""
        return self.max_position_embeddings if (self.rope_scaling or {}).get("rope_type") == "dynamic" else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence, eos_token_id first."""
        return tuple(dict.fromkeys((self.eos_token_id, *self.eos_token_ids)))

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            from llm_serving.protocol.moe_config import MoeSpec

            object.__setattr__(self, "moe", MoeSpec(**{**self.moe, "sparse_layers": tuple(self.moe["sparse_layers"])}))
        if self.architecture not in FAMILIES:
            raise ModelConfigError(f"unsupported architecture {self.architecture!r}; supported: {list(FAMILIES)}")
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim: {self.head_dim} must be even for the rotary embedding")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        """Width of the query heads together (the attention output's, the output projection's input)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row in the KV cache."""
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    def flops_per_token(self, context_len: int = 0) -> float:
        """Matmul FLOPs for one token (projections, lm_head and attention over ``context_len``)."""
        h = self.hidden_size
        per_layer = 2 * h * (self.qkv_dim + self.q_dim) + 4 * self.q_dim * context_len
        mlp = sum(self.mlp_rows(i) for i in range(self.num_hidden_layers))
        return self.num_hidden_layers * per_layer + 2 * h * mlp + 2 * h * self.vocab_size

    def mlp_rows(self, layer: int, experts: float | None = None) -> float:
        """Output rows of layer ``layer``'s MLP projections that one token reads (gate, up and down, each ``[f, h]``
        or its transpose): the dense MLP's, or a sparse layer's router, ``experts`` routed experts (default: the
        top k a token picks) and the shared expert."""
        moe = self.moe
        if moe is None or layer not in moe.sparse_layers:
            return 3 * self.intermediate_size
        picked = moe.top_k if experts is None else experts
        return moe.num_experts + 3 * (picked * moe.moe_intermediate_size + moe.shared_expert_intermediate_size) + (
            1 if moe.shared_expert_intermediate_size else 0)

    @classmethod
    def from_dict(cls, raw: JsonObject, source: str = "config") -> LlamaConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("model_type", SUPPORTED_ARCHITECTURES[arch]) != SUPPORTED_ARCHITECTURES[arch]:
            raise ModelConfigError(f"{source}: unsupported model_type {raw.get('model_type')!r} for {arch}")
        refuse_unserved_keys(raw, source, FAMILIES[arch])
        int8_weights = checkpoint_int8(raw, source)
        moe = None
        from llm_serving.protocol.moe_config import MOE_ARCHITECTURES, MoeSpec

        if arch in MOE_ARCHITECTURES:
            moe = MoeSpec.from_dict(raw, arch, source)
        try:
            heads = int(raw["num_attention_heads"])
            eos = 2 if raw.get("eos_token_id") is None else raw["eos_token_id"]  # transformers 5 writes null
            theta, scaling = rope_settings(raw, source)
            head_dim = raw.get("head_dim")
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                rope_theta=theta,
                bos_token_id=int(1 if raw.get("bos_token_id") is None else raw["bos_token_id"]),
                eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
                eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
                architecture=arch,
                explicit_head_dim=int(head_dim) if head_dim and head_dim * heads != raw["hidden_size"] else None,
                int8_weights=int8_weights,
                moe=moe,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source}: missing required key {exc.args[0]!r}") from None
        except ModelConfigError as exc:  # the dataclass's own checks, named with the file
            raise ModelConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> LlamaConfig:
        """config.json, with the end-of-sequence ids of generation_config.json added where there is one."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in model directory {model_dir}")
        config = cls.from_dict(json.loads(path.read_text()), source=str(path))
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            more = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
            config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys([*config.stop_ids, *more])))
        return config

    def as_dict(self) -> JsonObject:
        """The fields as JSON keeps them (lists, not tuples), so a config survives an AgentSpec round trip."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_hf_dict(self) -> JsonObject:
        """The config.json content Hugging Face's class of ``architecture`` expects."""
        d = asdict(self)
        del d["architecture"], d["explicit_head_dim"], d["int8_weights"], d["moe"]  # the float model's config
        if self.moe is not None:
            from llm_serving.protocol.moe_config import hf_keys

            d.update(hf_keys(self.moe, self.architecture, self.num_hidden_layers))
        d.update(architectures=[self.architecture], model_type=self.family.model_type, hidden_act="silu",
                 torch_dtype="float32", head_dim=self.head_dim)
        if not self.qkv_bias:  # Qwen2 has no such key: its q/k/v biases are always there
            d.update(attention_bias=False, mlp_bias=False)
        if self.rope_scaling is None:
            del d["rope_scaling"]
        d["eos_token_id"] = list(self.stop_ids) if len(self.stop_ids) > 1 else self.eos_token_id
        del d["eos_token_ids"]
        return d


def rope_settings(raw: JsonObject, source: str) -> tuple[float, JsonObject | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` (or transformers 5's ``rope_parameters``, which also
    holds rope_theta); a type without an implementation, or a missing parameter, is refused naming the key."""
    scaling: object = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"{source}: {key}: expected a mapping, got {scaling!r}")
    theta = float(scaling["rope_theta"] if "rope_theta" in scaling else raw.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    params = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")}
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise ModelConfigError(f"{source}: {key}: rope_type {kind!r} is not served; served: default, "
                               f"{', '.join(ROPE_TYPES)}")
    missing = [k for k in ROPE_TYPES[kind] if params.get(k) is None]
    if missing:
        raise ModelConfigError(f"{source}: {key}: rope_type {kind!r} needs {', '.join(missing)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{source}: {key}: partial_rotary_factor {params['partial_rotary_factor']} is not "
                               "served (every head dimension is rotated)")
    return theta, {"rope_type": kind, **params}


def checkpoint_int8(raw: JsonObject, source: str) -> bool:
    """Whether config.json's ``quantization_config`` says the checkpoint holds int8 weights (compressed-tensors
    W8A16, ``INT8_CHECKPOINT_*``); any other quantization, which the loader would misread, is refused naming the key.
    Which tensors are int8 the loader sees by their ``weight_scale`` (``ignore`` usually keeps the lm_head float)."""
    qc = raw.get("quantization_config")
    if qc is None:
        return False
    key = "quantization_config"
    if not isinstance(qc, dict):
        raise ModelConfigError(f"{source}: {key}: expected a mapping, got {qc!r}")
    if qc.get("quant_method") != "compressed-tensors":
        raise ModelConfigError(f"{source}: {key}.quant_method: {qc.get('quant_method')!r} is not served (only "
                               "'compressed-tensors' with int8 weights, a scale per output channel: W8A16)")
    if qc.get("format") not in INT8_CHECKPOINT_FORMATS:
        raise ModelConfigError(f"{source}: {key}.format: {qc.get('format')!r} is not served (only "
                               f"{' or '.join(map(repr, INT8_CHECKPOINT_FORMATS))})")
    for extra in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(extra):
            raise ModelConfigError(f"{source}: {key}.{extra}: {qc[extra]!r} is not served")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelConfigError(f"{source}: {key}.config_groups: expected a mapping of quantization schemes")
    for name, scheme in groups.items():
        where = f"{key}.config_groups.{name}"
        for acts in ("input_activations", "output_activations"):
            if scheme.get(acts):
                raise ModelConfigError(f"{source}: {where}.{acts}: quantized activations are not served (int8 "
                                       "weights with float activations only)")
        weights = scheme.get("weights") or {}
        for field, served in INT8_CHECKPOINT_WEIGHTS.items():
            if weights.get(field) != served:
                raise ModelConfigError(f"{source}: {where}.weights.{field}: {weights.get(field)!r} is not served "
                                       f"(only {served!r})")
        if weights.get("dynamic"):
            raise ModelConfigError(f"{source}: {where}.weights.dynamic: true is not served (static scales only)")
        if scheme.get("format") not in (None, *INT8_CHECKPOINT_FORMATS):
            raise ModelConfigError(f"{source}: {where}.format: {scheme['format']!r} is not served")
    return True


# config.json keys that change the maths, with the value the Llama layer computes; any other value is refused
_ONLY_SERVED = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None),
                "partial_rotary_factor": (1.0, 1, None), "qkv_bias": (True, None)}  # Qwen2-MoE's switch


def refuse_unserved_keys(raw: JsonObject, source: str, family: Family | None = None) -> None:
    """Refuse a config.json whose keys would change the model's maths in ways the layer does not compute, naming
    the key and file: a model is never served with a key silently ignored."""
    family = family or FAMILIES["LlamaForCausalLM"]
    for key, served in _ONLY_SERVED.items():
        if key == "attention_bias" and family.qkv_bias:
            continue  # transformers' Qwen2 reads no attention_bias: its q/k/v biases are always there
        if key in raw and raw[key] not in served:
            raise ModelConfigError(f"{source}: {key}: {raw[key]!r} is not served (only {served[0]!r})")
    window = raw.get("sliding_window")
    if "layer_types" in raw:  # transformers 5 names each layer's attention
        slides = "sliding_attention" in raw["layer_types"]
    elif family.model_type.startswith("qwen"):  # with use_sliding_window, from layer max_window_layers on
        slides = raw.get("use_sliding_window", False) and raw.get("max_window_layers", 28) < raw.get(
            "num_hidden_layers", 0)
    else:  # Mistral slides wherever a window is set
        slides = raw.get("use_sliding_window", True)
    if window is not None and slides and window < raw.get("max_position_embeddings", 4096):
        raise ModelConfigError(f"{source}: sliding_window: {window} (shorter than max_position_embeddings "
                               f"{raw.get('max_position_embeddings')}) is not served: attention here sees the whole "
                               "context")
