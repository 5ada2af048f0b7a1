"""The agents' graph compile cache (agents/runtime/compile_cache.py): a second start loads every warm-up graph from it
and serves the same greedy ids as transformers; a changed configuration never loads another's graphs; new
weights at the same path are used, not baked into the cached graphs; publishing is atomic; the config key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import yaml

from agents.runtime.compile_cache import COMPLETE, COSTS_FILE, KEEP, CompileCache, prune, source_digest
from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.engine.wiring import agent_spec, compile_cache_dir, resolve_model
from llm_serving.models.default_model import ensure_default_model
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.wire import AgentSpec

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "compile_cache_driver.py"
CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0)
RUNNER = {"num_blocks": 64, "block_size": 8, "max_model_len": 64, "prefill_batch_sizes": [4],
          "prefill_seq_lengths": [32], "decode_batch_sizes": [4], "kernels": "auto"}
PROMPTS = [[1, 17, 40, 99, 5], [1, 200, 3, 3, 8, 9, 120, 64, 33], [1, 250], [1, 77, 78, 79, 80, 81, 82]]
STEPS = 12
USED_CACHE = "GetCachedFuncGraph"  # MindSpore's log line for a graph loaded from the cache


def spec(tmp_path: Path, **runner) -> AgentSpec:
    return AgentSpec(kind="llama", model_path=str(tmp_path / "model"), llama_config=asdict(CONFIG),
                     runner_config={**RUNNER, **runner}, max_tokens=64, max_batch=4, max_blocks_per_seq=8,
                     compile_cache_dir=str(tmp_path / "cache"))


# ---- keys, publishing, pruning, the config key (no MindSpore) ---------------------------------------------
def test_each_configuration_rank_and_model_path_gets_its_own_directory(tmp_path):
    root = tmp_path / "cache"
    base = CompileCache(root, spec(tmp_path), 0)
    assert not base.hit and base.path.parent == root and base.path.name.startswith(base.final.name + ".tmp-")
    assert CompileCache(root, spec(tmp_path), 0).final == base.final  # same inputs, same directory
    others = [CompileCache(root, spec(tmp_path, decode_batch_sizes=[4, 8]), 0),
              CompileCache(root, spec(tmp_path, prefill_seq_lengths=[16, 32]), 0),
              CompileCache(root, spec(tmp_path, kernels="portable"), 0),
              CompileCache(root, spec(tmp_path), 1),
              CompileCache(root, replace(spec(tmp_path), model_path=str(tmp_path / "other")), 0)]
    assert len({base.final, *(o.final for o in others)}) == 1 + len(others)


def test_the_source_digest_covers_python_and_kernel_sources(tmp_path):
    for rel in ("agents/runtime/runner.py", "agents/model/kernels/linear.cc", "llm_serving/protocol/wire.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("a")
    before = source_digest(tmp_path)
    for rel in ("agents/runtime/runner.py", "agents/model/kernels/linear.cc", "llm_serving/protocol/wire.py"):
        (tmp_path / rel).write_text("b")
        after = source_digest(tmp_path)
        assert after != before, rel
        before = after
    (tmp_path / "agents" / "notes.txt").write_text("not source")
    assert source_digest(tmp_path) == before


def test_a_cache_is_published_whole_once_and_a_concurrent_filler_discards_its_own(tmp_path):
    first, second = (CompileCache(tmp_path / "cache", spec(tmp_path), 0),
                     CompileCache(tmp_path / "cache", spec(tmp_path), 0))
    assert first.path != second.path and not first.final.exists()
    costs = {("decode", 4, 8): 0.01, ("ragged", 4, 32): 0.02}
    assert first.commit(costs) and (first.final / COMPLETE).is_file() and first.path == first.final
    assert not second.commit({("decode", 4, 8): 9.0}) and not second.path.exists()
    hit = CompileCache(tmp_path / "cache", spec(tmp_path), 0)
    assert hit.hit and hit.path == first.final and hit.costs == costs
    assert json.loads((first.final / "key.json").read_text())["rank"] == 0
    failed = CompileCache(tmp_path / "cache", spec(tmp_path, decode_batch_sizes=[2]), 0)
    failed.discard()
    assert not failed.path.exists() and not failed.final.exists()


def test_unreadable_costs_load_the_graphs_and_measure_again(tmp_path):
    cache = CompileCache(tmp_path / "cache", spec(tmp_path), 0)
    cache.commit({("decode", 4, 8): 0.01})
    (cache.final / COSTS_FILE).write_text("not json")
    again = CompileCache(tmp_path / "cache", spec(tmp_path), 0)
    assert again.hit and again.costs == {}


def test_prune_keeps_the_most_recently_used_and_removes_dead_starts_leftovers(tmp_path):
    root = tmp_path / "cache"
    caches = []
    for i in range(KEEP + 2):
        c = CompileCache(root, spec(tmp_path, decode_batch_sizes=[i + 1]), 0)
        c.commit({})
        os.utime(c.final / COMPLETE, (1000 + i, 1000 + i))
        caches.append(c.final)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = root / f"x.tmp-{dead.pid}-abc"
    mine = root / f"y.tmp-{os.getpid()}-abc"
    leftover.mkdir()
    mine.mkdir()
    (mine / COMPLETE).write_text("")  # a live start about to publish (another rank's, at the same moment)
    os.utime(mine / COMPLETE, (1, 1))
    prune(root)
    assert [c.exists() for c in caches] == [False, False] + [True] * KEEP
    assert not leftover.exists() and mine.exists()  # never counted among the whole caches, nor removed


def test_config_key_true_false_path_and_errors_name_the_key(tmp_path):
    from llm_serving.protocol.paths import cache_root

    assert compile_cache_dir(ServingConfig()) == str(cache_root() / "compile-cache")
    assert not compile_cache_dir(ServingConfig()).startswith(os.path.expanduser("~/.cache"))  # tests/conftest.py
    off = ServingConfig.from_dict({"serving_config": {"compile_cache": False}})
    assert compile_cache_dir(off) is None
    there = ServingConfig.from_dict({"serving_config": {"compile_cache": str(tmp_path / "cc")}})
    assert compile_cache_dir(there) == str(tmp_path / "cc")
    assert ServingConfig.from_dict({"serving_config": {"compile_cache": "false"}}).serving_config.compile_cache is False
    with pytest.raises(ConfigError, match=r"serving_config\.compile_cache: expected true, false or a directory path, "
                                          r"got 3 \(int\)"):
        ServingConfig.from_dict({"serving_config": {"compile_cache": 3}})
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=r"serving_config\.compile_cache: .*exists and is not a directory"):
        ServingConfig.from_dict({"serving_config": {"compile_cache": str(a_file)}})


# ---- real starts (MindSpore, one process each) ------------------------------------------------------------
def start(model: Path, cache: Path | None, **runner) -> tuple[dict, str]:
    """One agent start-up and greedy generation in a fresh process: (its JSON, MindSpore's log)."""
    args = {"model": str(model), "cache": None if cache is None else str(cache), "runner": {**RUNNER, **runner},
            "prompts": PROMPTS, "steps": STEPS}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MS_SUBMODULE_LOG_v": "{PIPELINE:2}"}  # show cache loads
    done = subprocess.run([sys.executable, str(DRIVER), json.dumps(args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def graph_files(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in path.rglob("*.mindir")}


@pytest.fixture(scope="module")
def hf_ids():
    from tests.hf_reference import hf_greedy, load_hf

    def ids(model_dir: Path) -> list[list[int]]:
        hf = load_hf(model_dir)
        return [hf_greedy(hf, p, STEPS)[0] for p in PROMPTS]
    return ids


def test_second_start_loads_every_graph_and_a_changed_config_or_new_weights_never_reuse_stale_ones(tmp_path, hf_ids):
    model, cache = tmp_path / "model", tmp_path / "cache"
    build_random_model(model, CONFIG, seed=3, std=0.2)
    want = hf_ids(model)

    cold, cold_log = start(model, cache)
    assert cold["hit"] is False and cold["tokens"] == want
    published = Path(cold["path"])
    assert published.parent == cache and (published / COMPLETE).is_file() and cold_log.count(USED_CACHE) == 0
    files = graph_files(published)
    assert len(files) == len(cold["shapes"]) >= 3  # one saved graph per warm-up shape

    warm, warm_log = start(model, cache)
    assert warm["hit"] is True and warm["path"] == cold["path"]
    assert warm_log.count(USED_CACHE) == len(warm["shapes"])  # every shape loaded, none compiled
    assert graph_files(published) == files  # nothing compiled again or rewritten
    assert warm["costs"] == cold["costs"]  # the saved costs, not a new measurement
    assert warm["tokens"] == want
    assert any("compile cache hit" in line for line in warm["progress"])

    changed, changed_log = start(model, cache, decode_batch_sizes=[2, 4])  # one more decode bucket
    assert changed["hit"] is False and changed["path"] != cold["path"] and changed_log.count(USED_CACHE) == 0
    assert len(graph_files(Path(changed["path"]))) == len(changed["shapes"]) == len(cold["shapes"]) + len(
        [s for s in changed["shapes"] if s[0] == "decode" and s[1] == 2])
    assert changed["tokens"] == want
    assert graph_files(published) == files

    build_random_model(model, CONFIG, seed=4, std=0.2)  # new weights, same path and configuration
    new_want = hf_ids(model)
    assert new_want != want
    reloaded, reloaded_log = start(model, cache)
    assert reloaded["hit"] is True and reloaded_log.count(USED_CACHE) == len(reloaded["shapes"])
    assert reloaded["tokens"] == new_want  # the graphs hold no weights: the new ones are served


def test_llm_serving_generate_twice_second_start_hits_the_cache(tmp_path):
    """The whole path: config key -> AgentSpec -> agent process; the second start reports a hit and answers the
    same ids."""
    sections = {
        "default_model": {"data_dir": str(tmp_path / "models"), "weights": "random", "hidden_size": 64,
                          "intermediate_size": 160, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                          "vocab_size": 1000, "seed": 5},
        "model_config": {"seq_length": [32], "prefill_batch_size": [2], "decode_batch_size": [4]},
        "pa_config": {"num_blocks": 64, "block_size": 8, "decode_seq_length": 64},
        "serving_config": {"compile_cache": str(tmp_path / "cc")},
    }
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(sections))
    cfg = ServingConfig.from_yaml(config_file)
    ensure_default_model(cfg.default_model, cfg.max_model_len)
    assert agent_spec(cfg, resolve_model(cfg)).compile_cache_dir == str(tmp_path / "cc")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["The river ran past the old mill and", "Once upon a time"]))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "llm_serving", "generate", "--config", str(config_file),
                               "--prompts", str(prompts), "--max-new-tokens", "8"], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done)
    assert "compile cache miss" in runs[0].stderr and "compile cache hit" in runs[1].stderr
    ids = [[json.loads(line)["token_ids"] for line in r.stdout.splitlines() if line.strip()] for r in runs]
    assert ids[0] == ids[1] and len(ids[0]) == 2
    assert len([d for d in (tmp_path / "cc").iterdir() if (d / COMPLETE).is_file()]) == 1


# ---- tensor parallelism (an engine of two ranks, one process each) ----------------------------------------
def test_tensor_parallel_ranks_start_warm_from_the_cache_with_identical_ids_and_a_killed_rank_restarts_warm(
        tmp_path, monkeypatch, capfd):
    """Graphs with collectives (all-reduce, all-gather) saved by a cold start of two ranks load on the next
    start, every one of them, and serve the greedy ids of the cold start and of one rank; a rank killed while
    serving is replaced by ranks that load their graphs again (nothing recompiled), with the same ids."""
    import signal

    from llm_serving.engine.loop import Engine
    from tests.test_engine import wait_for
    from tests.test_tensor_parallel import tp_config, workload

    monkeypatch.setenv("MS_SUBMODULE_LOG_v", "{PIPELINE:2}")  # MindSpore logs each graph loaded from the cache
    greedy = [(p, sp) for p, sp in workload() if sp.temperature == 0]
    cache = tmp_path / "cc"

    def run(tp: int, compile_cache: str | bool, kill_rank: int | None = None) -> dict:
        lines: list[str] = []
        engine = Engine(tp_config(tmp_path / "models", tp, serving_config={"compile_cache": compile_cache}))
        engine.start(progress=lines.append)
        out = {"progress": lines, "log": capfd.readouterr().err}
        try:
            out["ids"] = [s.result(timeout=120).token_ids for s in [engine.submit(p, sp) for p, sp in greedy]]
            if kill_rank is not None:
                used = {d: (d / COMPLETE).stat().st_mtime_ns for d in published()}
                decoded = engine.stats()["decode_steps"]
                streams = [engine.submit(p, sp) for p, sp in greedy]
                wait_for(lambda: engine.stats()["decode_steps"] > decoded + 2, 60, "decoding")
                os.kill(engine.agent_pids[kill_rank], signal.SIGKILL)
                out["after_kill"] = [s.result(timeout=180).token_ids for s in streams]
                out["restarts"] = engine.stats()["agent_restarts"]
                out["used_again"] = all((d / COMPLETE).stat().st_mtime_ns > t for d, t in used.items())
                out["restart_log"] = capfd.readouterr().err
        finally:
            engine.shutdown()
        return out

    def published() -> list[Path]:
        return sorted(d for d in cache.iterdir() if (d / COMPLETE).is_file())

    def graphs() -> dict[str, tuple[int, int]]:
        return {f"{d.name}/{name}": v for d in published() for name, v in graph_files(d).items()}

    tp1 = run(1, False)
    cold = run(2, str(cache))
    assert [ln for ln in cold["progress"] if "compile cache miss" in ln] and cold["log"].count(USED_CACHE) == 0
    ranks = published()
    assert [json.loads((d / "key.json").read_text())["rank"] for d in ranks] in ([0, 1], [1, 0])
    files = graphs()
    assert len(files) > 2 * len(greedy) and not [d for d in cache.iterdir() if ".tmp-" in d.name]

    warm = run(2, str(cache), kill_rank=1)
    assert [ln for ln in warm["progress"] if "compile cache hit" in ln] and not [
        ln for ln in warm["progress"] if "compile cache miss" in ln or "not on every rank" in ln]
    assert warm["log"].count(USED_CACHE) == len(files)  # every graph of both ranks loaded, none compiled
    assert warm["ids"] == cold["ids"] == tp1["ids"]
    assert len({t for ids in tp1["ids"] for t in ids}) > 20  # not degenerate

    assert warm["restarts"] == 1 and warm["used_again"]  # the new ranks hit their caches too
    assert warm["restart_log"].count(USED_CACHE) == len(files) and warm["after_kill"] == tp1["ids"]
    assert published() == ranks and graphs() == files  # nothing compiled again or rewritten

    evicted = next(d for d in ranks if json.loads((d / "key.json").read_text())["rank"] == 1)
    shutil.rmtree(evicted)  # rank 1 misses, rank 0 hits: both run every shape (loading would hang rank 1)
    mixed = run(2, str(cache))
    assert [ln for ln in mixed["progress"] if "agent 0: compile cache hit here but not on every rank" in ln]
    assert [ln for ln in mixed["progress"] if "agent 1: compile cache miss" in ln]
    assert mixed["ids"] == tp1["ids"] and published() == ranks and graphs().keys() == files.keys()  # refilled
    assert {k: v for k, v in graphs().items() if not k.startswith(evicted.name)} == {
        k: v for k, v in files.items() if not k.startswith(evicted.name)}  # rank 0's graphs untouched
