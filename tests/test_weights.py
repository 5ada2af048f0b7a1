"""Weight I/O: HF safetensors (via the `safetensors` package), MindSpore loaders, the seeded random model."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import agents.weights.checkpoints
from agents.weights.checkpoints import (
    canonical_shapes,
    load_hf_weights,
    load_mindspore_checkpoint,
    load_weights,
    save_mindspore_checkpoint,
    validate_weights,
)
from agents.weights.errors import WeightLoadError
from agents.weights.mindformers_names import gate_up_to_mindformers, qkv_to_mindformers
from llm_serving.models.random_model import build_random_model, random_hf_weights
from llm_serving.protocol.model_config import LlamaConfig

# GQA (4 heads, 2 kv heads) so q and k/v have different widths in the fused matrix.
CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def fuse_reference(hf: dict[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """The canonical layout written out by hand from HF tensors."""
    out = {"embed_tokens": hf["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention_norm"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.w_qkv"] = np.concatenate(
            [hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
             hf[p + "self_attn.v_proj.weight"]])
        out[f"layers.{i}.wo"] = hf[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.ffn_norm"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.w_gate_up"] = np.concatenate([hf[p + "mlp.gate_proj.weight"],
                                                       hf[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.w_down"] = hf[p + "mlp.down_proj.weight"]
    out["norm"] = hf["model.norm.weight"]
    out["lm_head"] = hf["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return out


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(actual) == list(expected)
    for k, want in expected.items():
        assert actual[k].shape == want.shape, k
        np.testing.assert_array_equal(actual[k], want, err_msg=k)


def mindformers_names(hf: dict[str, np.ndarray], cfg: LlamaConfig, fused: bool) -> dict[str, np.ndarray]:
    out = {"model.tok_embeddings.embedding_weight": hf["model.embed_tokens.weight"],
           "model.norm_out.weight": hf["model.norm.weight"], "lm_head.weight": hf["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"model.layers.{i}."
        q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        if fused:  # MindFormers 1.8.0's interleaved orders (agents/weights/mindformers_names.py)
            out[m + "attention.w_qkv.weight"] = qkv_to_mindformers(np.concatenate([q, k, v]), cfg)
            out[m + "feed_forward.w_gate_hidden.weight"] = gate_up_to_mindformers(np.concatenate([gate, up]))
        else:
            out.update({m + "attention.wq.weight": q, m + "attention.wk.weight": k,
                        m + "attention.wv.weight": v,
                        m + "feed_forward.w1.weight": gate, m + "feed_forward.w3.weight": up})
        out.update({m + "attention.wo.weight": hf[h + "self_attn.o_proj.weight"],
                    m + "feed_forward.w2.weight": hf[h + "mlp.down_proj.weight"],
                    m + "attention_norm.weight": hf[h + "input_layernorm.weight"],
                    m + "ffn_norm.weight": hf[h + "post_attention_layernorm.weight"]})
    return out


def save_ckpt(tensors: dict[str, np.ndarray], path: Path, bf16: bool = False) -> Path:
    import mindspore as ms

    from agents.runtime.device import setup_device

    setup_device("CPU")  # the cast runs a kernel: the device is set first, as a later test in this process sets it
    items = []
    for name, arr in tensors.items():
        t = ms.Tensor(arr)
        items.append({"name": name, "data": t.astype(ms.bfloat16) if bf16 else t})
    ms.save_checkpoint(items, str(path))
    return path


# ---------------------------------------------------------------- safetensors reading


def test_float_dtypes_load_exactly_and_owned(tmp_path):
    """F32/F16/F64 (and big-endian input, which the writer stores little-endian) mixed in one file."""
    dtypes = [np.float32, np.float16, np.float64, np.dtype(">f4")]
    hf = {name: arr.astype(dtypes[j % len(dtypes)])
          for j, (name, arr) in enumerate(random_hf_weights(CFG).items())}
    save_file(hf, str(tmp_path / "mixed.safetensors"))
    got = load_weights(tmp_path / "mixed.safetensors", CFG, dtype=np.float64)
    assert all(v.dtype == np.float64 and v.flags.writeable and v.flags.c_contiguous for v in got.values())
    assert_same(got, {k: v.astype(np.float64) for k, v in fuse_reference(hf, CFG).items()})
    got["norm"][0] = 7.0  # owned: writing does not touch the file
    assert load_weights(tmp_path / "mixed.safetensors", CFG)["norm"][0] != 7.0


def test_bf16_and_fp16_written_by_torch_load_exactly(tmp_path):
    import torch
    from safetensors.torch import save_file as torch_save

    hf = random_hf_weights(CFG, seed=7, std=3.0)
    kinds = [torch.bfloat16, torch.float16, torch.float32]
    stored = {name: torch.from_numpy(arr).to(kinds[j % 3]) for j, (name, arr) in enumerate(hf.items())}
    torch_save(stored, str(tmp_path / "t.safetensors"))
    assert {str(t.dtype) for t in stored.values()} == {"torch.bfloat16", "torch.float16", "torch.float32"}
    got = load_weights(tmp_path / "t.safetensors", CFG, dtype=np.float64)
    assert_same(got, {k: v.astype(np.float64) for k, v in
                      fuse_reference({k: t.float().numpy() for k, t in stored.items()}, CFG).items()})
    # really rounded to bf16, not read as something else
    assert not np.array_equal(got["embed_tokens"], hf["model.embed_tokens.weight"])


def test_bf16_hf_checkpoint_loads_as_float32(tmp_path):
    import torch
    from safetensors.torch import save_file as torch_save

    hf = random_hf_weights(CFG, seed=4)
    build_random_model(tmp_path, CFG)
    torch_save({k: torch.from_numpy(v).bfloat16() for k, v in hf.items()},
               str(tmp_path / "model.safetensors"))
    rounded = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in hf.items()}
    got = load_weights(tmp_path, CFG)
    assert all(v.dtype == np.float32 and v.flags.writeable for v in got.values())
    assert_same(got, fuse_reference(rounded, CFG))


def test_reads_only_needed_tensors_once_each(tmp_path, monkeypatch):
    """Lazy: tensors come off disk one by one as the fusing needs them; errors found from names read none."""
    reads: list[str] = []
    real_open = agents.weights.checkpoints.safe_open

    class SpyOpen:
        def __init__(self, path, framework):
            self._file = real_open(path, framework=framework)

        def get_tensor(self, name):
            reads.append(name)
            return self._file.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self._file, attr)

    monkeypatch.setattr(agents.weights.checkpoints, "safe_open", SpyOpen)
    tied = replace(CFG, tie_word_embeddings=True)
    hf = random_hf_weights(CFG)  # holds lm_head.weight, which a tied model never reads
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    hf[inv_freq] = np.zeros(4, np.float32)  # ignored, never read
    load_weights(write_hf(tmp_path / "single", hf, tied), tied)
    assert sorted(reads) == sorted(set(hf) - {"lm_head.weight", inv_freq})

    reads.clear()
    sharded = build_random_model(tmp_path / "sharded", CFG, shards=3)
    load_weights(sharded, CFG)
    assert sorted(reads) == sorted(random_hf_weights(CFG))

    reads.clear()
    with pytest.raises(WeightLoadError, match="belongs to layer 2"):
        load_weights(write_hf(tmp_path / "deeper", random_hf_weights(replace(CFG, num_hidden_layers=3))), CFG)
    assert reads == []
    with pytest.raises(WeightLoadError, match="shape mismatch"):
        load_weights(sharded, replace(CFG, intermediate_size=48))
    assert reads[-1] == "model.layers.0.mlp.gate_proj.weight" and len(reads) < 10


def raw_safetensors(header: dict, data_len: int) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + b"\0" * data_len


@pytest.mark.parametrize("blob, message", [
    (b"\x01\x02", "header too small"),
    (struct.pack("<Q", 10**12) + b"{}", "header too large"),
    (struct.pack("<Q", 4) + b"{{{{", "invalid JSON"),
    (struct.pack("<Q", 2) + b"[]", "invalid JSON"),
    (raw_safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8), "not fully covered"),
    (raw_safetensors({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, 16), "invalid shape"),
    (raw_safetensors({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, 4), "Q9"),
    (raw_safetensors({"w": {"dtype": "F32", "shape": [1]}}, 4), "data_offsets"),
    (raw_safetensors({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4), "-1"),
])
def test_corrupt_safetensors_errors(tmp_path, blob, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(WeightLoadError, match="bad.safetensors: not a readable safetensors file") as exc:
        load_weights(path, CFG)
    assert message in str(exc.value)


def test_truncated_files_name_the_file(tmp_path):
    single = build_random_model(tmp_path / "single", CFG) / "model.safetensors"
    single.write_bytes(single.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match="model.safetensors: not a readable safetensors file.*not full"):
        load_weights(single.parent, CFG)
    shard = build_random_model(tmp_path / "sharded", CFG, shards=3) / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(WeightLoadError, match="model-00002-of-00003.safetensors: not a readable"):
        load_weights(shard.parent, CFG)


def test_non_float_tensor_dtypes_are_named(tmp_path):
    hf = random_hf_weights(CFG)
    hf["model.norm.weight"] = np.ones(32, np.int32)
    with pytest.raises(WeightLoadError, match="tensor 'model.norm.weight' has unsupported dtype I32"):
        load_weights(write_hf(tmp_path / "i", hf), CFG)
    # An fp8 tensor: valid safetensors that numpy cannot represent.
    path = tmp_path / "f8.safetensors"
    path.write_bytes(raw_safetensors({"model.embed_tokens.weight": {
        "dtype": "F8_E4M3", "shape": [96, 32], "data_offsets": [0, 96 * 32]}}, 96 * 32))
    with pytest.raises(WeightLoadError, match="f8.safetensors: tensor 'model.embed_tokens.weight' has "
                                              "unsupported dtype F8_E4M3 .supported: F64, F32, F16, BF16"):
        load_weights(path, CFG)


# ---------------------------------------------------------------- random model <-> transformers


@pytest.mark.parametrize("tie", [False, True])
def test_random_model_loads_in_transformers_with_identical_tensors(tmp_path, tie):
    from transformers import LlamaForCausalLM

    cfg = replace(CFG, tie_word_embeddings=tie)
    tok = tmp_path / "src.model"
    tok.write_bytes(b"sentencepiece-bytes")
    out = build_random_model(tmp_path / "m", cfg, seed=3, std=0.5, tokenizer_model=tok)
    assert (out / "tokenizer.model").read_bytes() == b"sentencepiece-bytes"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tie

    expected = random_hf_weights(cfg, seed=3, std=0.5)
    assert ("lm_head.weight" in expected) is not tie
    state = {k: v.numpy() for k, v in LlamaForCausalLM.from_pretrained(out).state_dict().items()}
    for name, arr in expected.items():
        np.testing.assert_array_equal(state[name], arr, err_msg=name)
    np.testing.assert_array_equal(state["lm_head.weight"], expected["lm_head.weight" if not tie else
                                                                    "model.embed_tokens.weight"])
    assert_same(load_weights(out, cfg), fuse_reference(state, cfg))

    # Seeded: the same seed gives the same weights; std scales matrices; norms stay near 1.
    again = random_hf_weights(cfg, seed=3, std=0.5)
    other = random_hf_weights(cfg, seed=4, std=0.5)
    emb = "model.embed_tokens.weight"
    np.testing.assert_array_equal(again[emb], expected[emb])
    assert not np.array_equal(other[emb], expected[emb])
    assert 0.4 < expected[emb].std() < 0.6
    norm = expected["model.norm.weight"]
    assert abs(norm.mean() - 1) < 0.1 and norm.std() > 0


def test_random_model_fp16_shards_load_and_cast(tmp_path):
    out = build_random_model(tmp_path, CFG, seed=1, dtype="float16", shards=4)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert shard_files == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    hf = random_hf_weights(CFG, seed=1, dtype="float16")
    assert all(v.dtype == np.float16 for v in hf.values())
    got = load_weights(out, CFG, dtype=np.float32)
    assert all(v.dtype == np.float32 and v.flags.writeable for v in got.values())
    assert_same(got, {k: v.astype(np.float32) for k, v in fuse_reference(hf, CFG).items()})
    # Rebuilding as one file replaces the shards rather than leaving both for the loader to mix up.
    build_random_model(tmp_path, CFG, seed=1)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_sharded_save_pretrained_loads_and_fuses(tmp_path, dtype):
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(HFLlamaConfig(**CFG.to_hf_dict()))
    with torch.no_grad():  # HF initialises norms to exactly 1; make them distinguishable
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    assert_same(load_weights(tmp_path, CFG), fuse_reference(state, CFG))


# ---------------------------------------------------------------- MindSpore checkpoints


def test_mindspore_canonical_round_trip_is_exact(tmp_path):
    src = build_random_model(tmp_path / "hf", CFG, seed=2)
    weights = load_weights(src, CFG)
    ckpt = save_mindspore_checkpoint(weights, tmp_path / "conv" / "model.ckpt")
    assert_same(load_mindspore_checkpoint(ckpt, CFG), weights)
    assert_same(load_weights(ckpt, CFG), weights)
    assert_same(load_weights(ckpt.parent, CFG), weights)  # a directory with only model.ckpt
    half = load_weights(ckpt.parent, CFG, dtype="float16")
    assert all(v.dtype == np.float16 for v in half.values())
    with pytest.raises(ValueError, match="must end in .ckpt"):
        save_mindspore_checkpoint(weights, tmp_path / "model.bin")


@pytest.mark.parametrize("fused", [False, True])
def test_mindformers_checkpoint_loads_to_canonical(tmp_path, fused):
    hf = random_hf_weights(CFG, seed=5)
    tensors = mindformers_names(hf, CFG, fused)
    # Training checkpoints also carry optimizer state, which the loader must skip.
    tensors["adam_m.model.layers.0.attention.wo.weight"] = np.zeros((32, 32), np.float32)
    tensors["global_step"] = np.array([7], np.int32)
    ckpt = save_ckpt(tensors, tmp_path / "mf.ckpt")
    assert_same(load_mindspore_checkpoint(ckpt, CFG), fuse_reference(hf, CFG))


def test_bf16_mindformers_checkpoint_widens_to_float32(tmp_path):
    import torch

    hf = random_hf_weights(CFG, seed=6)
    ckpt = save_ckpt(mindformers_names(hf, CFG, fused=True), tmp_path / "mf.ckpt", bf16=True)
    rounded = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in hf.items()}
    raw = load_mindspore_checkpoint(ckpt, CFG)
    assert all(v.dtype == np.float32 for v in raw.values())  # numpy has no bf16: widened at load
    assert_same(raw, fuse_reference(rounded, CFG))


# ---------------------------------------------------------------- error paths


def write_hf(dir_: Path, tensors: dict[str, np.ndarray], cfg: LlamaConfig = CFG) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(tensors, str(dir_ / "model.safetensors"))
    return dir_


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(WeightLoadError, match=f"weights not found: {tmp_path / 'nope'}"):
        load_weights(tmp_path / "nope", CFG)
    with pytest.raises(WeightLoadError, match=f"model directory not found: {tmp_path / 'nope'}"):
        load_hf_weights(tmp_path / "nope", CFG)
    with pytest.raises(WeightLoadError, match=f"MindSpore checkpoint not found: {tmp_path / 'x.ckpt'}"):
        load_mindspore_checkpoint(tmp_path / "x.ckpt", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadError,
                       match="no model.safetensors, model.safetensors.index.json or model.ckpt"):
        load_weights(tmp_path / "empty", CFG)
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(WeightLoadError, match="unsupported weights file .*w.bin"):
        load_weights(tmp_path / "w.bin", CFG)


def test_missing_shard_and_missing_index(tmp_path):
    out = build_random_model(tmp_path, CFG, shards=3)
    shard = out / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(WeightLoadError, match="missing shard file") as exc:
        load_weights(out, CFG)
    assert str(shard) in str(exc.value)
    shard.write_bytes(data)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="maps 'model.norm.weight' to .*00001-of-00003.safetensors"):
        load_weights(out, CFG)
    (out / "model.safetensors.index.json").unlink()
    with pytest.raises(WeightLoadError,
                       match="model-00001-of-00003.safetensors.* but no model.safetensors.index"):
        load_weights(out, CFG)


def test_missing_tensor_is_named(tmp_path):
    hf = random_hf_weights(CFG)
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(WeightLoadError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_weights(write_hf(tmp_path / "a", hf), CFG)
    hf = random_hf_weights(CFG)
    del hf["lm_head.weight"]  # fine only when the config ties embeddings
    assert load_weights(write_hf(tmp_path / "b", hf), replace(CFG, tie_word_embeddings=True))["lm_head"].shape
    with pytest.raises(WeightLoadError, match="missing tensor 'lm_head.weight'"):
        load_weights(write_hf(tmp_path / "c", hf), CFG)


def test_missing_mindformers_tensor_mentions_fused_alternative(tmp_path):
    tensors = mindformers_names(random_hf_weights(CFG), CFG, fused=False)
    del tensors["model.layers.0.feed_forward.w3.weight"]
    ckpt = save_ckpt(tensors, tmp_path / "mf.ckpt")
    with pytest.raises(WeightLoadError, match="missing tensor 'model.layers.0.feed_forward.w3.weight' "
                                              r"\(or model.layers.0.feed_forward.w_gate_hidden.weight\)"):
        load_weights(ckpt, CFG)


def test_shape_mismatch_names_parameter_and_shapes(tmp_path):
    out = build_random_model(tmp_path, CFG)
    with pytest.raises(WeightLoadError) as exc:
        load_weights(out, replace(CFG, intermediate_size=48))
    assert ("shape mismatch for 'model.layers.0.mlp.gate_proj.weight': expected (48, 32) from the config, "
            "got (40, 32)") in str(exc.value)
    ckpt = save_mindspore_checkpoint(load_weights(out, CFG), tmp_path / "c.ckpt")
    with pytest.raises(WeightLoadError, match=r"shape mismatch for 'embed_tokens': expected \(100, 32\)"):
        load_weights(ckpt, replace(CFG, vocab_size=100))


def test_unexpected_architecture_and_extra_tensors(tmp_path):
    out = build_random_model(tmp_path / "m", CFG)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(WeightLoadError, match=r"unexpected architecture \['GPT2LMHeadModel'\]"):
        load_weights(out, CFG)

    gpt2 = {"transformer.wte.weight": np.zeros((96, 32), np.float32)}
    with pytest.raises(WeightLoadError, match="unexpected architecture: no 'model.embed_tokens.weight'.*"
                                              "transformer.wte.weight"):
        load_weights(write_hf(tmp_path / "g", gpt2), CFG)
    with pytest.raises(WeightLoadError, match="unexpected architecture: neither canonical"):
        load_weights(save_ckpt(gpt2, tmp_path / "g.ckpt"), CFG)

    hf = random_hf_weights(CFG)
    hf["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)  # old HF files: ignored
    with pytest.raises(WeightLoadError, match=r"1 tensor\(s\) not used .*q_proj.bias"):
        load_weights(write_hf(tmp_path / "b", hf), CFG)

    deeper = random_hf_weights(replace(CFG, num_hidden_layers=3))
    with pytest.raises(WeightLoadError, match="'model.layers.2.input_layernorm.weight' belongs to layer 2 "
                                              "but the config has num_hidden_layers=2"):
        load_weights(write_hf(tmp_path / "d", deeper), CFG)


def test_corrupt_files_raise_weight_load_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"garbage!garbage!")
    with pytest.raises(WeightLoadError, match="model.safetensors: not a readable safetensors file"):
        load_weights(tmp_path, CFG)
    (tmp_path / "bad.ckpt").write_bytes(b"garbage")
    with pytest.raises(WeightLoadError, match="bad.ckpt: cannot read MindSpore checkpoint"):
        load_weights(tmp_path / "bad.ckpt", CFG)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(WeightLoadError, match="not a valid safetensors index"):
        load_weights(tmp_path / "x", CFG)


def test_validate_weights_and_argument_checks(tmp_path):
    weights = {k: np.zeros(s, np.float32) for k, s in canonical_shapes(CFG).items()}
    validate_weights(weights, CFG)
    assert len(weights) == 3 + 6 * CFG.num_hidden_layers
    with pytest.raises(WeightLoadError, match=r"shape mismatch for 'layers.1.w_qkv': expected \(64, 32\)"):
        validate_weights({**weights, "layers.1.w_qkv": np.zeros((32, 32))}, CFG)
    del weights["layers.1.w_down"]
    with pytest.raises(WeightLoadError, match="missing tensor 'layers.1.w_down'"):
        validate_weights(weights, CFG)
    with pytest.raises(ValueError, match="floating point"):
        load_weights(tmp_path, CFG, dtype=np.int32)
    with pytest.raises(ValueError, match="shards must be between 1 and"):
        build_random_model(tmp_path, CFG, shards=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_random_model(tmp_path, CFG, dtype="int8")
    with pytest.raises(FileNotFoundError, match="tokenizer model not found"):
        build_random_model(tmp_path, CFG, tokenizer_model=tmp_path / "none.model")
