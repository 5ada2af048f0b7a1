"""The YAML launch configuration: shipped files, every error path, overrides and path resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llm_serving.config.sections import ModelSection, PagedAttentionSection
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import resolve_model, scheduler_config
from llm_serving.models.default_model import TRAINED_MODEL
from llm_serving.protocol.paths import cache_root

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_YAML = ROOT / "configs" / "default.yaml"
EXAMPLE_YAML = ROOT / "configs" / "example.yaml"

# An unmodified llm-serving contest file (MindIR paths, llm-serving-only keys and sections).
CONTEST_YAML = """
model_path:
    prefill_model: ["/path/llama2-7b-mindir/full_graph.mindir"]
    decode_model: ["/path/llama2-7b-mindir/inc_graph.mindir"]
model_config:
    model_name: 'llama_7b'
    max_generate_length: 4096
    end_token: 2
    seq_length: [4096]
    vocab_size: 32000
    prefill_batch_size: [1]
    decode_batch_size: [128]
    zactivate_len: [512, 1024, 2048, 4096]
    model_type: 'dyn'
    seq_type: 'static'
    batch_waiting_time: 0.0
    decode_batch_waiting_time: 0.0
    batching_strategy: 'continuous'
    current_index: False
    page_attention: True
    model_dtype: "DataType.FLOAT16"
    pad_token_id: 0
    backend: 'kbk'
    model_cfg_path: 'mindformers/configs/llama2/predict_llama2_7b.yaml'
serving_config:
    agent_ports: [16002]
    start_device_id: 0
    server_ip: '127.0.0.1'
    server_port: 8835
pa_config:
    num_blocks: 1024
    block_size: 16
    decode_seq_length: 4096
tokenizer:
    type: LlamaTokenizer
    vocab_file: 'checkpoint_download/llama2/tokenizer.model'
basic_inputs:
    type: LlamaBasicInputs
extra_inputs:
    type: LlamaExtraInputs
warmup_inputs:
    type: LlamaWarmupInputs
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def error_of(d: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ServingConfig.from_dict(d, source="test.yaml")
    return info.value


# ----- shipped files ----------------------------------------------------------------------------------------
def test_default_yaml_is_the_builtin_defaults_and_serves_the_embedded_model():
    cfg = ServingConfig.from_yaml(DEFAULT_YAML)
    assert cfg == ServingConfig() == ServingConfig.from_dict({})
    assert cfg.notes == ()
    assert cfg.uses_default_model and cfg.vocab_file is None
    assert (cfg.serving_config.server_ip, cfg.serving_config.server_port) == ("127.0.0.1", 8000)
    assert cfg.default_model.data_dir == str(cache_root())  # tests/conftest.py's, not the user's
    served = resolve_model(cfg)  # the shipped trained model: nothing built, nothing downloaded
    assert served.model_path == TRAINED_MODEL and served.tokenizer_path == TRAINED_MODEL / "tokenizer.model"
    arch = served.llama_config
    assert (arch.hidden_size, arch.num_hidden_layers, arch.head_dim, arch.kv_dim, arch.vocab_size) == (256, 4, 64, 128,
                                                                                                       4096)
    assert cfg.max_num_batched_tokens == 4 * 256 and cfg.max_prompt_len == 256
    assert cfg.num_agents == 1


def test_example_yaml_loads_with_compat_notes():
    cfg = ServingConfig.from_yaml(EXAMPLE_YAML)
    m = cfg.model_config
    assert m.model_path == "/path/to/Llama-2-7b-hf" and not cfg.uses_default_model
    assert m.dtype == "float16" and m.end_token == 2 and m.vocab_size == 32000
    assert m.seq_length == (512, 1024, 2048, 4096) and m.decode_batch_size[-1] == 128
    assert cfg.vocab_file == "/path/to/Llama-2-7b-hf/tokenizer.model"
    assert cfg.max_model_len == 4096 and cfg.max_num_batched_tokens == 8192
    assert cfg.model_names == ("llama_7b", "llama2", "llama-2-7b")
    notes = "\n".join(cfg.notes)
    for ignored in ("zactivate_len", "batching_strategy", "agent_ip", "basic_inputs", "warmup_inputs"):
        assert ignored in notes


def test_every_example_key_is_documented_by_a_comment():
    """Each key line sits under a comment (a group of keys may share one), and every field is in the file."""
    lines = EXAMPLE_YAML.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("   ") and not line.lstrip().startswith("#"):
            j = i - 1
            while lines[j].startswith("  ") and not lines[j].lstrip().startswith("#"):
                j -= 1  # walk back over the keys of the same group
            assert lines[j].lstrip().startswith("#"), f"undocumented key: {line.strip()}"
    written = yaml.safe_load(EXAMPLE_YAML.read_text())
    for section, keys in ServingConfig().to_dict().items():
        assert set(keys) <= set(written[section]), (section, set(keys) - set(written[section]))


def test_unmodified_contest_file_loads(tmp_path):
    cfg = ServingConfig.from_yaml(write(tmp_path, CONTEST_YAML))
    assert cfg.model_config.dtype == "float16"  # from model_dtype
    assert cfg.model_config.backend == "kbk"
    assert cfg.model_config.model_cfg_path == str(tmp_path / "mindformers/configs/llama2/predict_llama2_7b.yaml")
    assert cfg.tokenizer.vocab_file == str(tmp_path / "checkpoint_download/llama2/tokenizer.model")
    assert cfg.uses_default_model  # MindIR paths are not weights we can load
    assert any("'model_path' ignored" in n and "model_config.model_path" in n for n in cfg.notes)
    # ... and the usual command-line fix-up works on it
    served = cfg.with_overrides(model_path=str(tmp_path / "llama"))
    assert served.model_config.model_path == str(tmp_path / "llama") and served.notes == cfg.notes


# ----- structural errors ------------------------------------------------------------------------------------
def test_unknown_section_names_it_the_file_and_the_known_sections():
    err = error_of({"model_confg": {}})
    msg = str(err)
    assert "test.yaml" in msg and "'model_confg'" in msg and "did you mean 'model_config'" in msg
    assert "serving_config" in msg and "default_model" in msg and err.key == "model_confg"


def test_unknown_key_names_it_the_file_and_the_known_keys():
    err = error_of({"pa_config": {"num_block": 8}})
    msg = str(err)
    assert msg.startswith("test.yaml: unknown key 'num_block' in section 'pa_config'")
    assert "did you mean 'num_blocks'" in msg and "block_size, decode_seq_length" in msg
    assert err.key == "pa_config.num_block" and err.source == "test.yaml"


@pytest.mark.parametrize("d, key, expected", [
    ({"model_config": {"seq_length": "abc"}}, "model_config.seq_length", "a list of integers"),
    ({"model_config": {"seq_length": [64, "128"]}}, "model_config.seq_length", "a list of integers"),
    ({"model_config": {"max_generate_length": 1.5}}, "model_config.max_generate_length", "an integer"),
    ({"serving_config": {"server_port": "8000"}}, "serving_config.server_port", "an integer"),
    ({"pa_config": {"num_blocks": True}}, "pa_config.num_blocks", "an integer or auto"),
    ({"scheduler": {"max_wait_s": "fast"}}, "scheduler.max_wait_s", "a number"),
    ({"serving_config": {"model_aliases": [7]}}, "serving_config.model_aliases", "a list of strings"),
    ({"model_config": {"page_attention": "maybe"}}, "model_config.page_attention", "a boolean (true/false)"),
    ({"model_config": {"model_path": 5}}, "model_config.model_path", "a path string"),
    ({"model_config": {"zactivate_len": "x"}}, "model_config.zactivate_len", "a list of integers"),
    ({"serving_config": {"enable_host_post_sampling": 1}}, "serving_config.enable_host_post_sampling",
     "a boolean (true/false)"),
])
def test_wrong_type_names_key_file_expected_type_and_value(d, key, expected):
    err = error_of(d)
    value = next(iter(next(iter(d.values())).values()))
    assert str(err) == f"test.yaml: {key}: expected {expected}, got {value!r} ({type(value).__name__})"
    assert err.key == key


@pytest.mark.parametrize("d, match", [
    ([1, 2], "top level must be a mapping of sections, got [1, 2] (list)"),
    ({"pa_config": [1]}, "section 'pa_config' must be a mapping of keys, got [1] (list)"),
    ({"basic_inputs": "LlamaBasicInputs"}, "section 'basic_inputs' must be a mapping"),
])
def test_sections_must_be_mappings(d, match):
    assert match in str(error_of(d))


# ----- semantic errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("d, key, match", [
    ({"scheduler": {"policy": "lifo"}}, "scheduler.policy", "fcfs, longest_output_first, priority, got 'lifo'"),
    ({"tokenizer": {"reasoning_parser": "granite"}}, "tokenizer.reasoning_parser", "qwen3, deepseek_r1, got 'granite'"),
    ({"model_config": {"dtype": "fp16"}}, "model_config.dtype", "float32, float16, bfloat16, got 'fp16'"),
    ({"model_config": {"model_dtype": "DataType.INT8"}}, "model_config.model_dtype", "'DataType.INT8'"),
    ({"model_config": {"seq_length": []}}, "model_config.seq_length", "at least one bucket"),
    ({"model_config": {"decode_batch_size": [0, 8]}}, "model_config.decode_batch_size", "positive"),
    ({"model_config": {"prefill_batch_size": [-1]}}, "model_config.prefill_batch_size", "positive"),
    ({"model_config": {"model_name": " "}}, "model_config.model_name", "empty"),
    ({"model_config": {"max_generate_length": 0}}, "model_config.max_generate_length", "positive"),
    ({"pa_config": {"block_size": 0}}, "pa_config.block_size", "positive"),
    ({"model_config": {"kernels": "fast"}}, "model_config.kernels", "auto, native, portable, got 'fast'"),
    ({"pa_config": {"num_blocks": 8, "block_size": 16}}, "pa_config.decode_seq_length",
     "do not fit in the cache of (num_blocks - 1) * block_size = (8 - 1) * 16 = 112 tokens"),
    ({"pa_config": {"num_blocks": 32, "block_size": 16}}, "pa_config.decode_seq_length", "block 0 is reserved"),
    ({"model_config": {"seq_length": [1024]}}, "model_config.seq_length", "exceeds pa_config.decode_seq_length"),
    ({"serving_config": {"agent_ports": []}}, "serving_config.agent_ports", "at least one entry"),
    ({"serving_config": {"server_port": 70000}}, "serving_config.server_port", "0..65535"),
    ({"serving_config": {"num_agents": 0}}, "serving_config.num_agents", "at least 1"),
    ({"serving_config": {"max_queue_size": 0}}, "serving_config.max_queue_size", ">= 1"),
    ({"serving_config": {"max_queue_wait_s": 0}}, "serving_config.max_queue_wait_s", "must be > 0"),
    ({"serving_config": {"model_aliases": [""]}}, "serving_config.model_aliases", "non-empty"),
    ({"tokenizer": {"type": "GPT2Tokenizer"}}, "tokenizer.type", "LlamaTokenizer"),
    ({"scheduler": {"max_wait_s": -1}}, "scheduler.max_wait_s", ">= 0"),
    ({"scheduler": {"max_num_batched_tokens": 300, "enable_chunked_prefill": False}},
     "scheduler.max_num_batched_tokens", "below pa_config.decode_seq_length 512"),
    ({"scheduler": {"max_num_batched_tokens": 16}}, "scheduler.max_num_batched_tokens",
     "below the largest decode batch 32"),
    ({"scheduler": {"min_decode_steps_between_prefills": -1}}, "scheduler.min_decode_steps_between_prefills",
     ">= 0"),
    ({"default_model": {"weights": "random", "num_heads": 3}}, "default_model",
     "not divisible by num_attention_heads 3"),
    ({"default_model": {"weights": "random", "num_kv_heads": 3}}, "default_model", "multiple of num_key_value_heads 3"),
    ({"default_model": {"weights": "random", "hidden_size": 12, "num_heads": 4, "num_kv_heads": 2}},
     "default_model.hidden_size", "even"),
    ({"default_model": {"weights": "random", "vocab_size": 0}}, "default_model.vocab_size", "positive"),
    ({"default_model": {"hidden_size": 128}}, "default_model.hidden_size", "describes the random model"),
    ({"default_model": {"weights": "pretrained"}}, "default_model.weights", "trained, random"),
    ({"speculative": {"method": "medusa"}}, "speculative.method", "'ngram', 'draft', 'self'"),
    ({"speculative": {"method": "draft"}}, "speculative.draft_model_path", "only of it"),
    ({"speculative": {"method": "ngram", "draft_layers": 2}}, "speculative.draft_layers", "only for it"),
    ({"speculative": {"method": "ngram"}, "scheduler": {"decode_steps": 4}}, "speculative.method", "choose one"),
    ({"speculative": {"num_tokens": 16}}, "speculative.num_tokens", "1..15"),
    ({"model_config": {"vocab_size": 0}}, "model_config.vocab_size", "positive"),
    ({"model_config": {"end_token": -1}}, "model_config.end_token", "token id >= 0"),
    ({"model_config": {"quantization": "int4"}}, "model_config.quantization", "none, w8a16, got 'int4'"),
    ({"model_config": {"quantization": "w8a16", "precision": "fast"}}, "model_config.quantization", "precision exact"),
    ({"model_config": {"quantization": "w8a16", "kernels": "portable"}}, "model_config.quantization",
     "kernels auto or native"),
    ({"model_config": {"quantization": "w8a16", "dtype": "float16"}}, "model_config.quantization", "dtype float32"),
    ({"model_config": {"kv_cache_dtype": "fp8"}}, "model_config.kv_cache_dtype", "auto, int8, got 'fp8'"),
    ({"model_config": {"kv_cache_dtype": "int8", "dtype": "float16"}}, "model_config.kv_cache_dtype",
     "needs dtype float32"),
    ({"model_config": {"kv_cache_dtype": "int8", "kernels": "portable"}}, "model_config.kv_cache_dtype",
     "kernels auto or native"),
])
def test_bad_values_name_the_key_and_the_problem(d, key, match):
    err = error_of(d)
    assert str(err).startswith(f"test.yaml: {key}: ") and match in str(err), str(err)
    assert err.key == key


# ----- files ------------------------------------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        ServingConfig.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        ServingConfig.from_yaml(tmp_path)


def test_bad_yaml_syntax_names_file_and_line(tmp_path):
    path = write(tmp_path, "model_config:\n  seq_length: [64, 128\npa_config:\n  block_size: 16\n")
    with pytest.raises(ConfigError) as info:
        ServingConfig.from_yaml(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: invalid YAML") and "line" in msg


def test_errors_from_a_file_name_the_file(tmp_path):
    path = write(tmp_path, "scheduler:\n  policy: random\n")
    with pytest.raises(ConfigError, match=rf"^{path}: scheduler.policy: expected one of"):
        ServingConfig.from_yaml(path)


def test_empty_file_and_empty_sections_give_defaults(tmp_path):
    assert ServingConfig.from_yaml(write(tmp_path, "")) == ServingConfig()
    assert ServingConfig.from_yaml(write(tmp_path, "model_config:\nscheduler:\n", "b.yaml")) == ServingConfig()


def test_null_values_take_defaults():
    cfg = ServingConfig.from_dict({"model_config": {"seq_length": None, "model_name": None},
                                   "serving_config": {"server_port": None}})
    assert cfg == ServingConfig()


# ----- values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("True", True), ("False", False), ("false", False),
                                            (" TRUE ", True), (True, True), (False, False)])
def test_string_booleans(text, expected):
    cfg = ServingConfig.from_dict({"model_config": {"page_attention": text, "current_index": text}})
    assert cfg.model_config.page_attention is expected
    assert any("page_attention: False ignored" in n for n in cfg.notes) is (not expected)


def test_string_booleans_from_yaml_quotes(tmp_path):
    cfg = ServingConfig.from_yaml(write(tmp_path, "model_config:\n  page_attention: 'False'\n"))
    assert cfg.model_config.page_attention is False


def test_buckets_are_sorted_and_deduplicated():
    cfg = ServingConfig.from_dict({"model_config": {"decode_batch_size": [32, 1, 8, 8],
                                                    "seq_length": [256, 64]}})
    assert cfg.model_config.decode_batch_size == (1, 8, 32) and cfg.model_config.seq_length == (64, 256)


def test_the_length_of_agent_ports_is_the_agent_count_unless_num_agents_is_set():
    cfg = ServingConfig.from_dict({"serving_config": {"agent_ports": [9002, 9001]}})
    assert cfg.num_agents == 2
    assert cfg.with_overrides(num_agents=1).num_agents == 1
    assert ServingConfig.from_dict({"serving_config": {"agent_ports": [], "num_agents": 3}}).num_agents == 3


def test_dtype_key_wins_over_llm_serving_model_dtype():
    cfg = ServingConfig.from_dict({"model_config": {"dtype": "bfloat16", "model_dtype": "DataType.FLOAT16"}})
    assert cfg.model_config.dtype == "bfloat16" and "model_dtype" in cfg.notes[0]
    cfg = ServingConfig.from_dict({"model_config": {"model_dtype": "DataType.BFLOAT16"}})
    assert cfg.model_config.dtype == "bfloat16" and cfg.notes == ()


def test_vocab_file_defaults_beside_the_weights():
    ckpt = ServingConfig.from_dict({"model_config": {"model_path": "/m/llama.ckpt"}})
    assert ckpt.vocab_file == "/m/tokenizer.model"
    hf = ServingConfig.from_dict({"model_config": {"model_path": "/m/llama"}})
    assert hf.vocab_file == "/m/llama/tokenizer.model"
    explicit = ServingConfig.from_dict({"model_config": {"model_path": "/m/llama"},
                                        "tokenizer": {"vocab_file": "/t/sp.model"}})
    assert explicit.vocab_file == "/t/sp.model"


# ----- paths ------------------------------------------------------------------------------------------------
def test_relative_paths_resolve_against_the_yaml_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "model_config:\n  model_path: ../models/llama\n  model_cfg_path: mf.yaml\n"
                           "tokenizer:\n  vocab_file: ./tok/tokenizer.model\n"
                           "default_model:\n  data_dir: cache\n", "conf/serve.yaml")
    cfg = ServingConfig.from_yaml(Path("conf/serve.yaml"))
    assert path.exists()
    assert cfg.model_config.model_path == str(tmp_path / "models" / "llama")
    assert cfg.model_config.model_cfg_path == str(tmp_path / "conf" / "mf.yaml")
    assert cfg.tokenizer.vocab_file == str(tmp_path / "conf" / "tok" / "tokenizer.model")
    assert cfg.default_model.data_dir == str(tmp_path / "conf" / "cache")


def test_home_is_expanded_and_empty_path_means_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = ServingConfig.from_dict({"model_config": {"model_path": "~/llama"}, "tokenizer": {"vocab_file": ""}},
                                  base_dir="/elsewhere")
    assert cfg.model_config.model_path == str(tmp_path / "llama") and cfg.tokenizer.vocab_file is None
    assert ServingConfig.from_dict({"model_config": {"model_path": "  "}}).uses_default_model


def test_from_dict_resolves_against_base_dir_or_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = {"model_config": {"model_path": "w"}}
    assert ServingConfig.from_dict(d).model_config.model_path == str(tmp_path / "w")
    assert ServingConfig.from_dict(d, base_dir="/srv").model_config.model_path == "/srv/w"


# ----- overrides and round trips ----------------------------------------------------------------------------
def test_with_overrides_returns_a_new_validated_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ServingConfig.from_yaml(DEFAULT_YAML)
    cfg = base.with_overrides(model_path="llama", host="0.0.0.0", port=9000, policy="fcfs",
                              decode_batch_size=[16, 4], prefill_batch_size=2, num_agents=3)
    assert cfg.model_config.model_path == str(tmp_path / "llama")
    assert (cfg.serving_config.server_ip, cfg.serving_config.server_port) == ("0.0.0.0", 9000)
    assert cfg.scheduler.policy == "fcfs"
    assert cfg.model_config.decode_batch_size == (4, 16) and cfg.model_config.prefill_batch_size == (2,)
    assert cfg.num_agents == 3
    assert cfg.max_num_batched_tokens == 512  # max_model_len beats 2 * 256
    assert base == ServingConfig() and base.with_overrides() is base
    assert "with overrides" in cfg.source


def test_a_derived_chunk_budget_carries_the_largest_decode_batch():
    """Chunked prefill without scheduler.max_num_batched_tokens: the derived budget holds every running sequence's
    decode token, so a decode batch above the prefill budget serves (it was a ValueError at engine start)."""
    big = {"model_config": {"decode_batch_size": [2048]}, "pa_config": {"num_blocks": 4096}}
    cfg = ServingConfig.from_dict(big)
    assert cfg.chunked_prefill and cfg.max_num_batched_tokens == 2048
    assert scheduler_config(cfg, 2).max_num_batched_tokens == 2048  # what the engine builds at start
    plain = ServingConfig.from_dict({**big, "scheduler": {"enable_chunked_prefill": False}})
    assert plain.max_num_batched_tokens == 4 * 256  # a prefill step's budget: decode steps are not budgeted
    scheduler_config(plain, 2)
    assert ServingConfig().max_num_batched_tokens == 4 * 256  # a smaller decode batch changes nothing


def test_bad_overrides_are_config_errors():
    base = ServingConfig()
    with pytest.raises(ConfigError, match="scheduler.policy: expected one of"):
        base.with_overrides(policy="random")
    with pytest.raises(ConfigError, match="model_config.decode_batch_size: buckets must be positive"):
        base.with_overrides(decode_batch_size=0)
    with pytest.raises(ConfigError, match="unknown key 'nope' in section 'scheduler'"):
        base.with_values({"scheduler.nope": 1})
    with pytest.raises(ConfigError, match="expected 'section.key'"):
        base.with_values({"policy": "fcfs"})


def test_with_values_sets_any_key(tmp_path):
    cfg = ServingConfig().with_values({"default_model.data_dir": str(tmp_path), "pa_config.num_blocks": 64})
    assert cfg.default_model.data_dir == str(tmp_path) and cfg.pa_config.num_blocks == 64


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = ServingConfig.from_yaml(EXAMPLE_YAML).with_overrides(num_agents=2)
    path = write(tmp_path, yaml.safe_dump(cfg.to_dict()), "dumped.yaml")
    assert ServingConfig.from_yaml(path) == cfg


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="^<defaults>: pa_config.block_size: must be positive"):
        ServingConfig(pa_config=PagedAttentionSection(block_size=0))
    with pytest.raises(ConfigError, match="must be sorted and unique"):
        ServingConfig(model_config=ModelSection(seq_length=(256, 64)))


def test_configs_are_frozen():
    cfg = ServingConfig()
    with pytest.raises(AttributeError):
        cfg.scheduler.policy = "fcfs"  # type: ignore[misc]


def test_config_module_does_not_import_mindspore():
    code = "import sys, llm_serving.config.serving_config; sys.exit('mindspore' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT).returncode == 0
