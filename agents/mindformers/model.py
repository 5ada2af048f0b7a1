"""Build MindFormers' ``LlamaForCausalLM`` from the user's predict YAML, with our serving settings and weights.

The YAML (``model_config.model_cfg_path``) keeps MindFormers' own model keys (qkv_concat, dtypes of norms and
softmax, rope settings, ...); the keys our serving configuration owns are set from it, and each YAML value they
replace is reported: the KV cache geometry (``pa_config``), the longest sequence, the compute dtype
(``model_config.dtype``), the paged-attention predict path (``use_past``, ``is_dynamic``, flash attention) and the
checkpoint (our loader reads ``model_config.model_path`` in any layout it knows and hands MindFormers its names).
Needs MindSpore 2.7.2 and MindFormers 1.8.0 with our patches (``scripts/mindformers_env.sh``).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from agents.weights.mindformers_names import to_mindformers
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.paths import cache_root

MINDFORMERS_VERSION = "1.8.0"  # the release our patches are for (patches/mindformers-1.8.0)
ENV_HINT = ("create the MindFormers environment with `bash scripts/mindformers_env.sh` (it prints its python) and "
            "run llm-serving from it")
PATCH_HINT = "apply our patches with `python -m llm_serving.cli.commands.patch_mindformers` in that environment"
# our LlamaConfig field -> MindFormers model_config key, checked to agree between config.json and the YAML
ARCH_KEYS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
             "num_key_value_heads": "n_kv_heads", "vocab_size": "vocab_size",
             "intermediate_size": "intermediate_size"}


def import_mindformers() -> Any:
    """The ``mindformers`` module, at the pinned version, or a RuntimeError saying how to get it."""
    # MindFormers logs under $LOCAL_DEFAULT_PATH (default ./output, wherever the agent was started): keep it in
    # our cache unless the user chose a place
    os.environ.setdefault("LOCAL_DEFAULT_PATH", str(cache_root() / "mindformers-output"))
    try:
        import mindformers
    except ImportError as exc:
        raise RuntimeError(f"model_config.backend mindformers: MindFormers is not importable ({exc}); "
                           f"{ENV_HINT}") from None
    version = importlib.metadata.version("mindformers")
    if version != MINDFORMERS_VERSION:
        raise RuntimeError(f"model_config.backend mindformers: MindFormers {version} is installed, our patches are "
                           f"for {MINDFORMERS_VERSION}; {ENV_HINT}")
    return mindformers


def read_model_config(yaml_path: str | Path) -> dict[str, Any]:
    """``model.model_config`` of a MindFormers YAML as a plain dict (MindFormers' own reader: ``MindFormerConfig``)."""
    from mindformers import MindFormerConfig

    path = Path(yaml_path)
    if not path.is_file():
        raise ValueError(f"model_config.model_cfg_path: {path} does not exist")
    cfg = MindFormerConfig(str(path))
    model = cfg.get("model") or {}
    mc = model.get("model_config")
    if not mc:
        raise ValueError(f"model_config.model_cfg_path: {path} has no model.model_config section")
    arch = (model.get("arch") or {}).get("type", "LlamaForCausalLM")
    if arch != "LlamaForCausalLM":
        raise ValueError(f"model_config.model_cfg_path: {path}: model.arch.type {arch!r}; the mindformers backend "
                         "builds LlamaForCausalLM")
    return {k: v for k, v in dict(mc).items() if k != "type"}


def check_architecture(mc: Mapping[str, Any], llama: LlamaConfig, yaml_path: str | Path, model_path: str) -> None:
    """The YAML and the checkpoint's config must describe the same model."""
    for ours, theirs in ARCH_KEYS.items():
        value = mc.get(theirs)
        if theirs == "n_kv_heads" and value is None:
            value = mc.get("num_heads")
        if theirs == "intermediate_size" and value is None:
            continue  # MindFormers derives it from multiple_of / ffn_dim_multiplier; the weights' shapes check it
        if value is not None and int(value) != getattr(llama, ours):
            raise ValueError(f"model_config.model_cfg_path: {yaml_path} says {theirs} {value}, the model at "
                             f"{model_path} has {ours} {getattr(llama, ours)}")


def serving_overrides(rc: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML keys our serving configuration sets (see the module docstring)."""
    return {"block_size": rc["block_size"], "num_blocks": rc["num_blocks"], "seq_length": rc["max_model_len"],
            "use_past": True, "is_dynamic": True, "use_flash_attention": True, "compute_dtype": rc["dtype"],
            "param_init_type": rc["dtype"], "rotary_dtype": rc["dtype"], "checkpoint_name_or_path": "",
            "batch_size": 1}


def build_network(yaml_path: str | Path, llama: LlamaConfig, rc: Mapping[str, Any], model_path: str,
                  progress: Callable[[str], None] | None = None) -> Any:
    """MindFormers' LlamaForCausalLM in predict mode with the in-graph greedy pick (our patch), weights unloaded."""
    import_mindformers()
    os.environ["RUN_MODE"] = "predict"  # read by LlamaForCausalLM.__init__ (get_predict_run_mode)
    from mindformers import LlamaConfig as MFLlamaConfig
    from mindformers import LlamaForCausalLM

    mc = read_model_config(yaml_path)
    check_architecture(mc, llama, yaml_path, model_path)
    for key, value in serving_overrides(rc).items():
        if key in mc and mc[key] != value and progress and key != "checkpoint_name_or_path":
            progress(f"{yaml_path}: {key} {mc[key]!r} -> {value!r} (from the serving config)")
        mc[key] = value
    conf = MFLlamaConfig(**mc)
    conf.greedy_in_graph = True  # our patch's switch
    net = LlamaForCausalLM(conf)
    net.set_train(False)
    if not hasattr(net, "greedy_pick"):
        import mindformers

        raise RuntimeError(f"MindFormers at {Path(mindformers.__file__).parent} is not patched: {PATCH_HINT}")
    return net


def load_weights_into(net: Any, weights: Mapping[str, np.ndarray], llama: LlamaConfig) -> None:
    """Our canonical weights under MindFormers' names (fused when the YAML says ``qkv_concat``), cast to each
    parameter's dtype; every parameter but the KV caches must receive one."""
    import mindspore as ms

    named = to_mindformers(weights, llama, fused=bool(net.config.qkv_concat))
    params, missing = {}, []
    for name, param in net.parameters_and_names():
        if name.endswith(("key_cache", "value_cache")):
            continue
        if name not in named:
            missing.append(name)
            continue
        value = np.asarray(named[name], np.float32)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"weight {name}: shape {value.shape}, MindFormers' parameter has {tuple(param.shape)}")
        params[name] = ms.Parameter(ms.Tensor(value, dtype=param.dtype), name=name)
    if missing:
        raise ValueError(f"no weights for MindFormers parameters {missing[:4]}")
    not_loaded, _ = ms.load_param_into_net(net, params)
    left = [n for n in not_loaded if not n.endswith(("key_cache", "value_cache"))]
    if left:
        raise ValueError(f"MindFormers parameters not loaded: {left[:4]}")
