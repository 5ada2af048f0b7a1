"""The parts of benchmark.py --peers that need no peer venv: the request/result files a runner reads and writes,
the closed-loop limiter the in-process peers use, the id comparison, the section's rows for levels a peer does
not run, llama.cpp's greedy loop (with fakes for the model), our in-process row's loop (stand-in agents) and
token-id/ignore_eos bodies of the load client. The peers' runners themselves (OpenVINO GenAI, CTranslate2,
llama.cpp) run only in the benchmark (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from peers.compare import System, markdown, parse_levels
from peers.peer_io import (
    SATURATION,
    ClosedLoop,
    LevelRun,
    PeerFileError,
    PeerRequest,
    PeerResult,
    RequestFile,
    Timing,
    batches,
    compare_ids,
    first_difference,
    read_requests,
    read_results,
    summarize,
    write_requests,
    write_results,
)

from llm_serving.bench import BenchError
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig


def request_file(n: int = 5, low: int = 3) -> RequestFile:
    reqs = [PeerRequest(i, [1, 10 + i, 20 + i], 4 + i) for i in range(n)]
    return RequestFile("/models/x", 2, [SATURATION, 1, 8], low, reqs)


def test_request_file_round_trip_and_levels(tmp_path):
    rf = request_file()
    write_requests(tmp_path / "r.json", rf)
    back = read_requests(tmp_path / "r.json")
    assert back == rf
    assert [r.index for r in back.level_requests(SATURATION)] == [0, 1, 2, 3, 4]
    assert [r.index for r in back.level_requests(8)] == [0, 1, 2]  # low-load levels: the first 3


@pytest.mark.parametrize("change, message", [
    (lambda o: o.update(format="other"), "not a llm-serving-peer-requests/1"),
    (lambda o: o["requests"][1].update(prompt_ids=[]), "request 1 prompt_ids"),
    (lambda o: o["requests"][0].update(prompt_ids=[1, "a"]), "request 0 prompt_ids"),
    (lambda o: o["requests"][2].update(max_new_tokens=0), "request 2 max_new_tokens"),
    (lambda o: o.update(levels=[-1]), "levels must be >= 0"),
])
def test_request_file_errors_name_the_problem(tmp_path, change, message):
    write_requests(tmp_path / "r.json", request_file())
    obj = json.loads((tmp_path / "r.json").read_text())
    change(obj)
    (tmp_path / "r.json").write_text(json.dumps(obj))
    with pytest.raises(PeerFileError, match=message):
        read_requests(tmp_path / "r.json")


def test_results_round_trip_and_summary(tmp_path):
    timings = [Timing(0, [5, 6, 7], 0.0, 0.5, 0.1), Timing(1, [8], 0.1, 0.3, None)]
    res = PeerResult("p", "1.0", "settings", None, 1.5, [LevelRun(SATURATION, 0.5, timings)])
    write_results(tmp_path / "o.json", res)
    back = read_results(tmp_path / "o.json")
    assert back == res
    run = back.runs[0]
    assert run.output_tokens == 4 and timings[0].tpot == pytest.approx(0.2) and timings[1].tpot is None
    s = summarize(run)
    assert s["tokens_per_s"] == pytest.approx(8.0)
    assert s["mean_latency_s"] == pytest.approx(0.35) and s["mean_ttft_s"] == pytest.approx(0.1)
    assert s["mean_tpot_s"] == pytest.approx(0.2)
    # our server's timings carry a token count, not ids
    assert Timing(3, None, 0.0, 1.0, 0.2, tokens=5).tpot == pytest.approx(0.2)


def test_results_say_why_levels_were_not_run(tmp_path):
    res = PeerResult("llamacpp", "0.3", "s", 1.0, 0.5, [LevelRun(1, 1.0, [])], not_run="one sequence at a time")
    write_results(tmp_path / "o.json", res)
    assert read_results(tmp_path / "o.json") == res
    obj = json.loads((tmp_path / "o.json").read_text())
    del obj["not_run"]  # a file from a runner that runs every level
    (tmp_path / "o.json").write_text(json.dumps(obj))
    assert read_results(tmp_path / "o.json").not_run == ""


def test_section_rows_of_a_level_a_peer_does_not_run():
    def run(level: int, wall: float) -> LevelRun:
        return LevelRun(level, wall, [Timing(0, [5, 6], 0.0, wall, 0.1 * wall)])

    hf = System("HF", "baseline", runs={1: [run(1, 2.0)]})
    ours = System("ours", "served", runs={1: [run(1, 1.0), run(1, 1.0)], 8: [run(8, 0.5), run(8, 0.5)]})
    llama = System("llama.cpp, F32", "F32", runs={1: [run(1, 0.5), run(1, 0.5)]}, not_run="one sequence at a time")
    args = argparse.Namespace(peer_rounds=2, max_output_tokens=2, low_load_requests=1)
    md = markdown([hf, ours, llama], ours, [1, 8], args, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    one, eight = md.split("#### 8 in flight")
    assert "| llama.cpp, F32 | 0/0 | 2 | 0.50 | 4.0 | 2.00x |" in one
    assert "| llama.cpp, F32 | not run: one sequence at a time | | | | | | | |" in eight
    assert "- llama.cpp, F32: 1 in flight 0.50, 0.50\n" in eight  # no empty "8 in flight" in the round totals


def test_llamacpp_greedy_loop_makes_exactly_n_ids_whatever_they_are(monkeypatch):
    """Every pick is EOS (2): the loop still makes n ids, evaluating the prompt once and each pick but the last
    (the runner itself needs llama_cpp, which only its venv has)."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "peers"))
    from run_llamacpp import context_size, greedy

    evaluated: list[list[int]] = []
    clock = iter([7.0, 99.0])
    ids, first = greedy(lambda ids: evaluated.append(list(ids)), lambda: 2, [1, 10, 11], 4, lambda: next(clock))
    assert ids == [2, 2, 2, 2] and first == 7.0
    assert evaluated == [[1, 10, 11], [2], [2], [2]]
    assert greedy(lambda ids: evaluated.append(list(ids)), lambda: 5, [1], 1)[0] == [5]
    assert context_size(request_file()) == 3 + 8  # the longest prompt + its max_new_tokens


@pytest.mark.parametrize("level", [SATURATION, 1, 2])
def test_ours_in_process_runner_keeps_the_limit_and_ignores_eos(monkeypatch, tmp_path, level):
    """The in-process row's loop (scripts/peers/run_ours.py) on our engine with stand-in agents: every request
    gets its max_new_tokens ids (the stand-in's rule, EOS included), requests start in file order, and no more
    than ``level`` overlap."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "peers"))
    import asyncio

    from run_ours import run_level
    from test_engine import standin_expected, tiny_config

    from llm_serving.core.sequence import SamplingParams
    from llm_serving.engine.llm import LLM

    reqs = [PeerRequest(i, [1, 10 + i, 20 + i], 3 + i % 4) for i in range(7)]
    rf = RequestFile("/models/x", 2, [level], 7, reqs)
    with LLM(tiny_config(tmp_path), standin_agents=True, progress=None) as llm:
        run = asyncio.run(run_level(llm, rf, level))
    assert [t.index for t in run.timings] == list(range(7))
    for t, r in zip(run.timings, reqs):
        assert t.output_ids == standin_expected(r.prompt_ids, SamplingParams(r.max_new_tokens, ignore_eos=True))[0]
        assert t.start_s <= t.first_token_s <= t.end_s <= run.wall_s
    starts = [t.start_s for t in run.timings]
    assert starts == sorted(starts)
    limit = level or len(reqs)
    for t in run.timings:  # requests running when t starts (t included)
        assert sum(o.start_s <= t.start_s < o.end_s or o is t for o in run.timings) <= limit


def test_closed_loop_keeps_the_limit_and_the_order():
    loop = ClosedLoop(5, 2)
    assert loop.to_start() == [0, 1] and loop.to_start() == []
    loop.finish(1)
    assert loop.to_start() == [2]
    loop.finish(0)
    loop.finish(2)
    assert loop.to_start() == [3, 4] and not loop.done
    with pytest.raises(ValueError, match="not in flight"):
        loop.finish(0)
    loop.finish(4)
    loop.finish(3)
    assert loop.done and loop.to_start() == []
    everything = ClosedLoop(4, SATURATION)
    assert everything.to_start() == [0, 1, 2, 3]


def test_static_batches():
    assert batches(5, 2) == [range(2), range(2, 4), range(4, 5)]
    assert batches(3, SATURATION) == [range(3)] and batches(0, 8) == []


def test_ids_comparison():
    ref = [[1, 2, 3], [4, 5], [6]]
    runs = [Timing(0, [1, 2, 3], 0, 1), Timing(1, [4, 9], 0, 1), Timing(2, None, 0, 1, tokens=1)]
    assert compare_ids(ref, runs) == (1, 3, [1, 2])
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1], [1]) is None


def test_levels_option():
    assert parse_levels("all,1,8") == [SATURATION, 1, 8]
    with pytest.raises(SystemExit, match="'0'"):
        parse_levels("all,0")


def test_token_id_prompts_and_ignore_eos_bodies():
    req = BenchRequest(0, "text", 7, 3, prompt_ids=[1, 5, 9])
    body = BenchConfig(endpoint="openai", ignore_eos=True).body(req)
    assert body["prompt"] == [1, 5, 9] and body["ignore_eos"] is True and body["max_tokens"] == 7
    plain = BenchConfig(endpoint="openai").body(BenchRequest(0, "text", 7, 3))
    assert plain["prompt"] == "text" and "ignore_eos" not in plain
    with pytest.raises(BenchError, match="openai endpoint"):
        BenchConfig(endpoint="stream").body(req)
