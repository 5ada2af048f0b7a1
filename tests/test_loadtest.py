"""Load tool, report and workload generator, against a fake llm-serving/OpenAI server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
from aiohttp import web
from matplotlib.figure import Figure

from llm_serving.bench import BenchError, plots
from llm_serving.bench.arrivals import arrival_offsets
from llm_serving.bench.dataset import contest_prompt, load_dataset
from llm_serving.bench.local_server import wait_ready
from llm_serving.bench.metrics import parse_gauge
from llm_serving.bench.workload import LengthDist, WorkloadError, WorkloadSpec, make_workload
from llm_serving.bench.workload import main as workload_main
from llm_serving.tokenization.tokenizer import Tokenizer
from llm_serving.tokenization.training import train_tokenizer
from loadtest.cli import main as loadtest_main
from loadtest.client import ProgressBar, benchmark
from loadtest.dataset import BenchRequest
from loadtest.protocol import BenchConfig

TTFT = 0.08  # fake server: delay before the first token
ITL = 0.01  # fake server: delay between tokens


class FakeServer:
    """The three endpoints with fixed delays; prompts containing FAIL get HTTP 500, HANG never answer in time,
    BADLINE get an error object inside the stream. Runs its own event loop in a thread."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.running = 0
        self.max_running = 0
        self.send_usage = True  # honour OpenAI stream_options.include_usage
        self.speculating = False  # /metrics has the speculative-decoding counters
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> int:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/models/{model}/generate_stream", self.stream)
        app.router.add_post("/models/{model}/generate", self.full)
        app.router.add_post("/v1/completions", self.openai)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return self.runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _admit(self, request: web.Request) -> tuple[str, int, dict] | web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals.append(time.perf_counter())
        prompt = body.get("inputs", body.get("prompt"))
        n = body["parameters"]["max_new_tokens"] if "parameters" in body else body["max_tokens"]
        if "FAIL" in prompt:
            return web.json_response({"error": "injected failure", "error_type": "internal"}, status=500)
        if "HANG" in prompt:
            await asyncio.sleep(2.0)
        return prompt, n, body

    async def _tokens(self, n: int):
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(TTFT)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL)
                yield i, f" w{i}"
        finally:
            self.running -= 1

    async def stream(self, request: web.Request) -> web.StreamResponse:
        admitted = await self._admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        prompt, n, body = admitted
        resp = web.StreamResponse()
        await resp.prepare(request)
        texts = []
        async for i, piece in self._tokens(n):
            texts.append(piece)
            line = {"event": "message", "retry": 30000,
                    "data": [{"generated_text": piece, "tokens": {"id": i, "text": piece}, "details": None}]}
            await resp.write(json.dumps(line).encode() + b"\n")
            if "FLUSH" in prompt and i == n - 1:  # text released at the end, no token of its own
                texts.append("!")
                line["data"][0].update(generated_text="!", tokens=None)
                await resp.write(json.dumps(line).encode() + b"\n")
            if "BADLINE" in prompt:
                await resp.write(b'{"error": "agent crashed", "error_type": "internal"}\n')
                break
        if body["parameters"].get("return_full_text") == "True":
            full = {"event": "message", "retry": 30000,
                    "data": [{"generated_text": "".join(texts), "tokens": {}, "details": None}]}
            await resp.write(json.dumps(full).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def full(self, request: web.Request) -> web.Response:
        admitted = await self._admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        _, n, _ = admitted
        pieces = [p async for _, p in self._tokens(n)]
        return web.json_response({"generated_text": "".join(pieces), "finish_reason": "length",
                                  "generated_tokens": n, "prompt_tokens": 17, "tokens": []})

    async def openai(self, request: web.Request) -> web.StreamResponse:
        admitted = await self._admit(request)
        if isinstance(admitted, web.Response):
            return admitted
        _, n, body = admitted
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for _, piece in self._tokens(n):
            chunk = {"object": "text_completion",
                     "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        if self.send_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [],
                     "usage": {"prompt_tokens": 42, "completion_tokens": n, "total_tokens": n + 42}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        text = f"# TYPE llm_serving_running_batch_size gauge\nllm_serving_running_batch_size {self.running}\n"
        if self.speculating:  # per request so far: 2 drafts of 4 proposals, 5 accepted
            n = len(self.bodies)
            text += (f"llm_serving_spec_decode_drafts_total {2.0 * n}\nllm_serving_spec_decode_proposed_tokens_total "
                     f"{8.0 * n}\nllm_serving_spec_decode_accepted_tokens_total {5.0 * n}\n")
        return web.Response(text=text)


@pytest.fixture
def server():
    s = FakeServer()
    s.port = s.start()
    yield s
    s.stop()


def write_dataset(path: Path, outputs_words: list[int], prompts: list[str] | None = None) -> Path:
    prompts = prompts or [f"instruction {i}" for i in range(len(outputs_words))]
    records = [{"instruction": p, "input": "context" if i % 2 else "", "output": " ".join(["word"] * w)}
               for i, (p, w) in enumerate(zip(prompts, outputs_words))]
    path.write_text(json.dumps(records))
    return path


def run_cli(tmp_path: Path, server: FakeServer, dataset: Path, *extra: str) -> tuple[int, dict, list[dict]]:
    out = tmp_path / "out"
    argv = ["-P", str(server.port), "-O", str(out), "--dataset", str(dataset), "--tokens-per-word", "1",
            "--no-progress", "--metrics-interval", "0.05", *extra]
    rc = loadtest_main(argv)
    qps = float(argv[argv.index("-X") + 1]) if "-X" in argv else 1.0
    summary = json.loads((out / f"summary_{qps}_x.json").read_text())
    results = json.loads((out / f"result_{qps}_x.json").read_text())
    return rc, summary["metrics"], results


def read_png(path: Path) -> np.ndarray:
    """An (H, W, 3) uint8 image of a PNG file written by the plots."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return np.rint(matplotlib.image.imread(path)[..., :3] * 255).astype(np.uint8)


def rgb(color: str) -> tuple[int, int, int]:
    return tuple(round(c * 255) for c in matplotlib.colors.to_rgb(color))


# ------------------------------------------------------------------------------------------ end to end
def test_stream_contest_defaults_metrics_and_files(tmp_path, server):
    words = [5, 8, 3]
    dataset = write_dataset(tmp_path / "alpaca.json", words)
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "4", "-T", "1")  # contest count: int(1 * 4)
    assert rc == 0
    assert m["successful_requests"] == 4 and m["failed_requests"] == 0
    # The contest's body, cycling through the dataset in order; prompt = instruction[":" + input].
    sent = sorted(server.bodies, key=lambda b: b["inputs"])
    assert all(b["parameters"]["do_sample"] == "False" and b["stream"] is True for b in sent)
    assert [r["input"] for r in results] == ["instruction 0", "instruction 1:context", "instruction 2",
                                             "instruction 0"]
    assert [r["max_new_tokens"] for r in results] == [5, 8, 3, 5]
    # The trailing full-text line is the answer, not a token.
    for r in results:
        assert r["resp_text"] == "".join(f" w{i}" for i in range(r["max_new_tokens"]))
        assert r["output_tokens"] == r["max_new_tokens"] and r["full_text_checked"] is True
    assert m["total_output_tokens"] == 21
    assert TTFT <= m["mean_ttft_ms"] / 1000 < TTFT + 0.06
    assert ITL * 0.8 <= m["median_itl_ms"] / 1000 < ITL + 0.02
    assert ITL * 0.8 <= m["mean_tpot_ms"] / 1000 < ITL + 0.02
    for r in results:  # E2E = TTFT + (n - 1) gaps
        assert r["res_time"] == pytest.approx(r["first_token_time"] + (r["output_tokens"] - 1) * r["tpot"])
        assert r["res_time"] >= TTFT + (r["output_tokens"] - 1) * ITL
    # Total time spans the last send to the last response.
    last = max(r["send_time"] + r["res_time"] for r in results)
    assert m["total_time_s"] == m["benchmark_duration_s"] and last <= m["total_time_s"] < last + 0.05
    assert m["request_throughput"] == pytest.approx(4 / m["total_time_s"])
    assert m["output_throughput"] == pytest.approx(21 / m["total_time_s"])
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in results)
    out = tmp_path / "out"
    report = (out / "report_4.0_x.md").read_text()
    assert "Total time, contest score (s)" in report and "latency_cdf_4.0_x.png" in report
    for name in ("latency_cdf", "throughput", "running_batch"):
        img = read_png(out / f"{name}_4.0_x.png")
        assert img.shape[0] > 300 and img.shape[1] > 600
        assert (img == rgb(plots.PALETTE[0])).all(axis=2).sum() > 50  # a drawn series, not just axes


def test_no_full_text_and_concurrency_cap_and_server_gauge(tmp_path, server):
    dataset = write_dataset(tmp_path / "d.json", [6] * 6)
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "6",
                             "--max-concurrency", "2", "--no-return-full-text")
    assert rc == 0
    assert all(b["parameters"]["return_full_text"] == "False" for b in server.bodies)
    assert all(r["output_tokens"] == 6 and r["full_text_checked"] is None for r in results)
    assert server.max_running == 2 and m["max_in_flight"] == 2
    assert m["max_server_running_batch"] is not None and 1 <= m["max_server_running_batch"] <= 2
    assert m["spec_acceptance_rate"] is None and m["spec_mean_acceptance_length"] is None  # no counters served
    # Three waves of two: the run takes about three request latencies.
    one = TTFT + 5 * ITL
    assert 3 * one <= m["total_time_s"] < 3 * one + 0.25


def test_the_servers_speculative_counters_over_the_run_reach_the_report(tmp_path, server):
    server.speculating = True
    server.bodies.extend([{}] * 3)  # counted before the run: only the run's change is reported
    rc, m, _ = run_cli(tmp_path, server, write_dataset(tmp_path / "d.json", [3] * 4), "-X", "inf", "--num-prompts", "4")
    assert rc == 0
    assert m["spec_acceptance_rate"] == pytest.approx(5 / 8) and m["spec_mean_acceptance_length"] == pytest.approx(3.5)
    report = (tmp_path / "out" / "report_inf_x.md").read_text()
    assert "| Speculative acceptance rate (server /metrics) | 0.62 |" in report
    assert "| Mean acceptance length (tokens per draft) | 3.50 |" in report


def test_stream_counts_token_lines_only(tmp_path, server):
    dataset = write_dataset(tmp_path / "d.json", [4], ["FLUSH"])
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "1", "--no-plots")
    assert rc == 0 and results[0]["resp_text"] == " w0 w1 w2 w3!" and results[0]["full_text_checked"]
    assert results[0]["output_tokens"] == 4 and m["total_output_tokens"] == 4


def test_full_endpoint(tmp_path, server):
    dataset = write_dataset(tmp_path / "d.json", [4, 7])
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "2",
                             "--endpoint", "full")
    assert rc == 0
    assert all(b["stream"] is False for b in server.bodies)
    assert [r["output_tokens"] for r in results] == [4, 7]
    assert m["total_input_tokens"] == 2 * 17  # the server's prompt_tokens, not the client's estimate
    assert all(r["first_token_time"] == r["res_time"] and r["tpot"] is None for r in results)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None
    assert m["mean_e2el_ms"] / 1000 >= TTFT + 5 * ITL * 0.8


def test_openai_endpoint(tmp_path, server):
    dataset = write_dataset(tmp_path / "d.json", [5, 2, 9])
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "3", "--endpoint",
                             "openai", "--model-name", "tiny")
    assert rc == 0
    assert all(b["model"] == "tiny" and b["stream"] is True and b["temperature"] == 0 for b in server.bodies)
    assert [r["output_tokens"] for r in results] == [5, 2, 9]
    assert m["total_input_tokens"] == 3 * 42  # from usage
    assert results[1]["resp_text"] == " w0 w1" and results[1]["finish_reason"] == "length"
    assert TTFT <= m["mean_ttft_ms"] / 1000 < TTFT + 0.06
    server.send_usage = False  # then one token per chunk with text; the closing finish_reason chunk is none
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "3", "--endpoint",
                             "openai", "--no-plots")
    assert rc == 0 and [r["output_tokens"] for r in results] == [5, 2, 9]
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in results) != 3 * 42


def test_failures_are_counted_not_fatal(tmp_path, server):
    prompts = ["ok a", "FAIL b", "ok c", "BADLINE d", "ok e", "FAIL f"]
    dataset = write_dataset(tmp_path / "d.json", [3] * 6, prompts)
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "6")
    assert rc == 1
    assert m["successful_requests"] == 3 and m["failed_requests"] == 3
    assert m["total_output_tokens"] == 9  # failed requests contribute nothing
    by_prompt = {r["input"].split(":")[0]: r for r in results}
    assert by_prompt["FAIL b"]["error"] == "HTTP 500 internal: injected failure"
    assert by_prompt["FAIL b"]["res_time"] is None
    assert "agent crashed" in by_prompt["BADLINE d"]["error"]
    assert m["errors"]["HTTP 500 internal"]["count"] == 2
    assert m["errors"]["server error in stream"]["count"] == 1


def test_request_timeout_bounds_the_run(tmp_path, server):
    dataset = write_dataset(tmp_path / "d.json", [2, 2], ["HANG", "fine"])
    t = time.perf_counter()
    rc, m, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "2",
                             "--request-timeout", "0.3", "--no-plots")
    assert time.perf_counter() - t < 1.5
    assert rc == 1 and m["failed_requests"] == 1
    assert results[0]["error"] == "timeout after 0.3s" and results[1]["success"]


def test_requests_leave_on_the_arrival_schedule(server):
    cfg = BenchConfig(port=server.port, qps=25, arrival="poisson", seed=7, metrics_interval=0)
    reqs = [BenchRequest(i, f"p{i}", 1, 2) for i in range(8)]
    run = asyncio.run(benchmark(reqs, cfg, progress=False))
    planned = arrival_offsets(8, 25, "poisson", seed=7)
    sends = np.array([r.send_time for r in run.results])
    assert np.abs(sends - planned).max() < 0.02
    seen = np.array(sorted(server.arrivals))
    assert np.abs(np.diff(seen) - np.diff(planned)).max() < 0.03


def test_tokenizer_counts_max_new_tokens(tmp_path, server):
    tok_path = train_tokenizer(tmp_path / "tok" / "tokenizer", vocab_size=900)
    tok = Tokenizer(tok_path)
    dataset = write_dataset(tmp_path / "d.json", [3, 6])
    rc, _, results = run_cli(tmp_path, server, dataset, "-X", "inf", "--num-prompts", "2", "--tokenizer",
                             str(tok_path), "--no-plots")
    assert rc == 0
    records = json.loads(dataset.read_text())
    expect = [len(tok.encode(r["output"], add_bos=False)) for r in records]
    assert [r["max_new_tokens"] for r in results] == expect
    assert [r["prompt_tokens"] for r in results] == [len(tok.encode(contest_prompt(r))) for r in records]


def test_wait_ready(server):
    asyncio.run(wait_ready(BenchConfig(port=server.port).base_url, 2.0))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(BenchError, match=f"127.0.0.1:{free} not ready after 0.3s"):
        asyncio.run(wait_ready(BenchConfig(port=free).base_url, 0.3))


def test_scripts_run_from_any_directory(tmp_path):
    root = Path(__file__).resolve().parent.parent
    made = subprocess.run([sys.executable, str(root / "scripts" / "make_workload.py"), "-n", "5"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert made.returncode == 0, made.stderr
    assert len(load_dataset(tmp_path / "alpaca_5010.json")) == 5  # the contest's default file name
    helped = subprocess.run([sys.executable, str(root / "scripts" / "test_serving_performance.py"), "--help"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert helped.returncode == 0
    assert "--dataset_path" in helped.stdout and "--max-concurrency" in helped.stdout


# ------------------------------------------------------------------------------------- arrival process
def _gaps(process: str, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    return np.diff(arrival_offsets(20001, 10.0, process, burstiness, seed))


def test_poisson_gaps_are_exponential():
    g = _gaps("poisson")
    assert abs(g.mean() - 0.1) < 0.004
    assert abs(g.std() / g.mean() - 1.0) < 0.05  # exponential: coefficient of variation 1
    assert abs((g < 0.1).mean() - (1 - math.exp(-1))) < 0.02  # P(gap < mean) = 1 - 1/e
    assert abs((g > 0.3).mean() - math.exp(-3)) < 0.01


def test_gamma_burstiness_and_constant():
    bursty = _gaps("gamma", burstiness=0.25)
    assert abs(bursty.mean() - 0.1) < 0.008
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.12  # CV = 1 / sqrt(shape)
    smooth = _gaps("gamma", burstiness=4.0)
    assert abs(smooth.std() / smooth.mean() - 0.5) < 0.03
    assert np.allclose(_gaps("constant"), 0.1)
    assert not np.array_equal(_gaps("poisson", seed=1), _gaps("poisson", seed=2))
    assert np.array_equal(_gaps("poisson", seed=3), _gaps("poisson", seed=3))
    assert not arrival_offsets(5, math.inf).any()
    with pytest.raises(BenchError, match="qps"):
        arrival_offsets(5, 0.0)
    with pytest.raises(BenchError, match="arrival"):
        arrival_offsets(5, 1.0, "uniform")


# ----------------------------------------------------------------------------------------- CLI errors
def test_cli_errors_name_the_problem(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert loadtest_main(["--dataset", str(missing), "--num-prompts", "1", "--no-progress"]) == 2
    assert str(missing) in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}, {"instruction": "a"}]))
    assert loadtest_main(["--dataset", str(bad), "--num-prompts", "1"]) == 2
    assert "record 1: key 'input'" in capsys.readouterr().err
    good = write_dataset(tmp_path / "good.json", [1])
    assert loadtest_main(["--dataset", str(good), "-X", "inf"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert loadtest_main(["--dataset", str(good), "-X", "1", "-T", "0.5"]) == 2
    assert "nothing to send" in capsys.readouterr().err


def test_progress_bar_and_gauge_parsing():
    class Sink:
        def __init__(self, tty: bool):
            self.text, self.tty = "", tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return self.tty

    def run(sink: Sink, enabled: bool = True) -> ProgressBar:
        bar = ProgressBar(20, enabled, file=sink)
        for i in range(20):
            bar.update(ok=i != 3)
        bar.close()
        return bar

    tty = Sink(tty=True)
    assert run(tty).failed == 1
    last = tty.text.replace("\r", "\n").splitlines()[-1]  # tqdm redraws its line in place
    assert "20/20" in last and "failed=1" in last
    for sink, enabled in ((Sink(tty=False), True), (Sink(tty=True), False)):  # not a terminal; --no-progress
        assert run(sink, enabled).failed == 1 and sink.text == ""
    metrics = 'x 1\nllm_serving_running_batch_size{m="a"} 3\nllm_serving_running_batch_size_max 9\n'
    assert parse_gauge(metrics, "llm_serving_running_batch_size") == 3.0
    assert parse_gauge("x 1\n", "llm_serving_running_batch_size") is None


def test_plots_without_data_and_latency_log_axis(tmp_path):
    paths = plots.write_plots([], 0.0, tmp_path, "1.0_x")  # nothing succeeded: "no data" panels, same files
    names = ("latency_cdf", "throughput", "running_batch")
    assert [p.name for p in paths] == [f"{name}_1.0_x.png" for name in names]
    assert all(read_png(p).shape[1] > 600 for p in paths)
    fig = Figure()
    wide, narrow = fig.subplots(1, 2)
    plots._latency_panel(wide, "itl", "Inter-token Latency", np.array([0.0, 1.5, 4.0, 9.0, 350.0]))
    plots._latency_panel(narrow, "ttft", "Time to First Token", np.array([80.0, 85.0, 90.0, 120.0]))
    assert wide.get_xscale() == "log" and narrow.get_xscale() == "linear"
    assert wide.get_legend() is not None and "latency (ms)" in wide.get_xlabel()


# ------------------------------------------------------------------------------------------- workload
def test_workload_deterministic_and_alpaca_shaped(tmp_path):
    spec = WorkloadSpec(num=300, seed=1)
    a, b = make_workload(spec), make_workload(spec)
    assert a == b and a != make_workload(WorkloadSpec(num=300, seed=2))
    assert all(set(r) == {"instruction", "input", "output"} and all(isinstance(v, str) and v or k == "input"
                                                                   for k, v in r.items()) for r in a)
    assert 0.3 < sum(bool(r["input"]) for r in a) / len(a) < 0.5
    words = np.array([len(r["output"].split()) for r in a])
    assert 25 <= np.median(words) <= 60 and words.max() <= 400 and words.min() >= 3
    assert np.percentile(words, 95) > 2.5 * np.median(words)  # long tail
    out = tmp_path / "alpaca_5010.json"
    assert workload_main(["-o", str(out), "-n", "20", "--seed", "1"]) == 0
    assert load_dataset(out) == make_workload(WorkloadSpec(num=20, seed=1))
    argv = ["-o", str(out), "-n", "100", "--max-input-words", "10", "--max-output-words", "50"]
    assert workload_main(argv) == 0
    capped = load_dataset(out)
    assert max(len(r["input"].split()) for r in capped) == 10
    assert max(len(r["output"].split()) for r in capped) == 50
    with pytest.raises(WorkloadError, match="num"):
        WorkloadSpec(num=0)
    with pytest.raises(WorkloadError, match="length distribution"):
        LengthDist(10, 0.5, 5, 2)


def test_wait_until_ready_notices_a_server_that_exited():
    import subprocess
    import sys

    from llm_serving.bench.local_server import ServerStartError, free_port, wait_until_ready

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait()
    with pytest.raises(ServerStartError, match="exited 3"):
        wait_until_ready(proc, free_port(), timeout_s=60.0)


def test_running_server_serves_until_the_block_ends_and_names_a_start_failure(tmp_path):
    """``running_server`` (the benchmark scripts' way to start ``llm-serving serve``): ready on its port inside
    the block, stopped after it; a server that cannot start raises ServerStartError."""
    import json
    import urllib.error
    import urllib.request

    from llm_serving.bench.local_server import ServerStartError, running_server

    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"default_model": {"data_dir": str(tmp_path / "models"), "weights": "random",
                                                    "hidden_size": 64, "intermediate_size": 160, "num_layers": 2,
                                                    "num_heads": 4, "num_kv_heads": 2, "vocab_size": 1000,
                                                    "seed": 3}}))
    announced: list[str] = []
    with running_server(config, tmp_path / "server.log", 120.0, cwd=tmp_path, extra_args=["--standin-agents"],
                        announce=announced.append) as (port, ready_s):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert resp.status == 200
        assert ready_s > 0 and f"--port {port}" in announced[0]
    with pytest.raises(urllib.error.URLError):  # stopped: nothing listens there any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)

    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: {policy: sideways}\n")
    with pytest.raises(ServerStartError, match="exited"), running_server(bad, tmp_path / "bad.log", 60.0):
        pass
    assert "scheduler.policy" in (tmp_path / "bad.log").read_text()


def test_the_default_dataset_is_made_on_first_use_outside_the_working_directory(tmp_path, server, monkeypatch,
                                                                                  capsys):
    """``./alpaca_5010.json`` (the contest's default) missing: the default workload is written to the cache root
    (tests/conftest.py's temporary one) once and used; the working directory stays clean."""
    from llm_serving.protocol.paths import cache_root

    monkeypatch.chdir(tmp_path)
    cached = cache_root() / "workloads" / "alpaca_5010.json"
    cached.unlink(missing_ok=True)  # an earlier test of this session (the simulator's) may have made it
    argv = ["-P", str(server.port), "-O", str(tmp_path / "out"), "--num-prompts", "2", "--no-progress",
            "--tokens-per-word", "1"]
    assert loadtest_main(argv) == 0
    assert len(json.loads(cached.read_text())) == 5010 and "wrote the default workload" in capsys.readouterr().err
    assert not (tmp_path / "alpaca_5010.json").exists()
    assert loadtest_main(argv) == 0 and "wrote" not in capsys.readouterr().err  # made once
