"""Llama architecture hyper-parameters (read from a Hugging Face ``config.json``) and the names of the
dtypes, kernel sets and devices an agent can run, which the master validates its configuration against."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# architecture -> its config.json model_type: Mistral is Llama's layer (without a sliding window shorter than the
# context, which refuse_unserved_keys refuses)
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
HF_SINGLE_FILE = "model.safetensors"  # a Hugging Face model directory's weights: one file,
HF_INDEX_FILE = "model.safetensors.index.json"  # or shards listed in this index
DTYPES = ("float32", "float16", "bfloat16")
KERNEL_CHOICES = ("auto", "native", "portable")  # CPU ops: native C++ where they build, portable graph ops
DEVICE_TARGETS = ("CPU", "Ascend")  # model_config.device_target
ASCEND_DTYPES = ("float16", "bfloat16")  # what the Ascend fused kernels take (PagedAttention refuses float32)
# rope_scaling types the rotary tables compute as transformers does (agents.model.rope), with the keys each needs
ROPE_TYPES = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"),
              "yarn": ("original_max_position_embeddings",)}
# model_config.precision: exact (the dtype's own arithmetic); half / fast: the native CPU projections with float16
# weights (float32 arithmetic) / bfloat16 weights and inputs (float32 sums); docs/benchmarks.md "Fast precision mode"
PRECISIONS = ("exact", "fast", "half")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV-cache blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class ModelConfigError(ValueError):
    """A model directory or config.json that cannot be served."""


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
    rope_scaling: dict | None = None
    # every end-of-sequence id (config.json's and generation_config.json's lists; Llama 3 instruct: <|end_of_text|>,
    # <|eom_id|>, <|eot_id|>): any of them ends a sequence. Empty: eos_token_id alone
    eos_token_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence, eos_token_id first."""
        return tuple(dict.fromkeys((self.eos_token_id, *self.eos_token_ids)))

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        """Width of one token's K (or V) row in the KV cache."""
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.hidden_size + 2 * self.kv_dim

    def flops_per_token(self, context_len: int = 0) -> float:
        """Matmul FLOPs for one token (projections, lm_head and attention over ``context_len``)."""
        h, f = self.hidden_size, self.intermediate_size
        per_layer = 2 * h * (self.qkv_dim + h + 3 * f) + 4 * self.hidden_size * context_len
        return self.num_hidden_layers * per_layer + 2 * h * self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> LlamaConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: unsupported architecture {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("model_type", SUPPORTED_ARCHITECTURES[arch]) != SUPPORTED_ARCHITECTURES[arch]:
            raise ModelConfigError(f"{source}: unsupported model_type {raw.get('model_type')!r} for {arch}")
        refuse_unserved_keys(raw, source)
        try:
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id", 2)
            theta, scaling = rope_settings(raw, source)
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
                bos_token_id=int(raw.get("bos_token_id", 1)),
                eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
                eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
            )
        except KeyError as exc:
            raise ModelConfigError(f"{source}: missing required key {exc.args[0]!r}") from None

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

    def as_dict(self) -> dict:
        """The fields as JSON keeps them (lists, not tuples), so a config survives an AgentSpec round trip."""
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_hf_dict(self) -> dict:
        """The config.json content Hugging Face ``LlamaForCausalLM`` expects."""
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 torch_dtype="float32", attention_bias=False, mlp_bias=False)
        if self.rope_scaling is None:
            del d["rope_scaling"]
        d["eos_token_id"] = list(self.stop_ids) if len(self.stop_ids) > 1 else self.eos_token_id
        del d["eos_token_ids"]
        return d


def rope_settings(raw: dict, source: str) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_scaling`` (or transformers 5's ``rope_parameters``, which also
    holds rope_theta); a type without an implementation, or a missing parameter, is refused naming the key."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"{source}: {key}: expected a mapping, got {scaling!r}")
    theta = float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    params = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")}
    if kind == "default":
        return theta, None
    if kind == "dynamic":
        raise ModelConfigError(f"{source}: {key}: rope_type 'dynamic' is not served: transformers rescales the "
                               "frequencies by the current sequence length, so a cached key's rotation would not "
                               "match what it computes; remove it (plain RoPE up to max_position_embeddings) or use "
                               "a static type")
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


# config.json keys that change the maths, with the value the Llama layer computes; any other value is refused
_ONLY_SERVED = {"hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None),
                "partial_rotary_factor": (1.0, 1, None)}


def refuse_unserved_keys(raw: dict, source: str) -> None:
    """Refuse a config.json whose keys would change the model's maths in ways the layer does not compute, naming
    the key and file: a model is never served with a key silently ignored."""
    for key, served in _ONLY_SERVED.items():
        if key in raw and raw[key] not in served:
            raise ModelConfigError(f"{source}: {key}: {raw[key]!r} is not served (only {served[0]!r})")
    heads = raw.get("num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != raw.get("hidden_size"):
        raise ModelConfigError(f"{source}: head_dim: {head_dim} differs from hidden_size / num_attention_heads "
                               f"({raw.get('hidden_size')} / {heads}), which is not served")
    window = raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", True) and window < raw.get("max_position_embeddings",
                                                                                           4096):
        raise ModelConfigError(f"{source}: sliding_window: {window} (shorter than max_position_embeddings "
                               f"{raw.get('max_position_embeddings')}) is not served: attention here sees the whole "
                               "context")
