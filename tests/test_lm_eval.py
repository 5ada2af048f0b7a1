"""EleutherAI's lm-evaluation-harness, unmodified, against the server (issue 30): its ``local-completions`` model
with its remote tokenizer (our ``/tokenizer_info`` and ``/tokenize``) runs a small multiple-choice task made here,
sending its loglikelihood requests (``echo`` with ``logprobs``, ``max_tokens`` 0 or 1). Every choice's
loglikelihood it records equals transformers' log-softmax of the same model over the same ids, and its
``is_greedy`` the argmax.

lm-eval lives in an environment of its own (``scripts/lm_eval_env.sh``, made by ``scripts/test.sh``); its
caches go to this test's temporary directory."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from llm_serving.config.serving_config import ServingConfig
from llm_serving.models.default_model import default_model_dir
from llm_serving.tokenization.tokenizer import Tokenizer
from tests.tiny_engine import TINY_SERVED

LM_EVAL_PYTHON = os.environ.get("LLM_SERVING_LM_EVAL_PYTHON")
pytestmark = pytest.mark.skipif(not LM_EVAL_PYTHON, reason="no lm-eval environment: LLM_SERVING_LM_EVAL_PYTHON="
                                "$(bash scripts/lm_eval_env.sh) (scripts/test.sh sets it for whole-suite runs)")

QUESTIONS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which of these numbers is prime?", "choices": ["four", "nine", "seven"], "answer": 2},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_evals_multiple_choice_loglikelihoods_are_transformers(tmp_path, tiny_server):
    data, tasks = tmp_path / "tiny_mc.jsonl", tmp_path / "tasks"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
           "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([LM_EVAL_PYTHON, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                          f"model=llama2,base_url={tiny_server.url}/v1/completions,num_concurrent=2,max_retries=1",
                          "--tasks", "tiny_mc", "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
                          "--log_samples"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "Using remote tokenizer" in res.stderr, res.stderr[-3000:]  # our /tokenizer_info and /tokenize
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
               for line in f.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == [0, 1, 2]

    cfg = ServingConfig().with_values({**TINY_SERVED, "default_model.data_dir": str(tiny_server.data_dir)})
    model_dir = default_model_dir(cfg.default_model, cfg.max_model_len)
    tok = Tokenizer(model_dir / "tokenizer.model")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            # lm-eval's split (api.model._encode_pair): the whole text encoded, the context's ids cut off its front
            whole, head = tok.encode(context + continuation, add_bos=False), tok.encode(context, add_bos=False)
            ids, cont = whole, whole[len(head):]
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
            rows = np.arange(len(ids) - len(cont) - 1, len(ids) - 1)
            expected = float(logprobs[rows, cont].sum())
            loglikelihood, greedy = float(resp[0][0]), resp[0][1] == "True"
            assert loglikelihood == pytest.approx(expected, abs=1e-4 * len(cont)), (context, continuation)
            assert greedy == bool((logprobs[rows].argmax(-1) == cont).all())
        lls = [float(r[0][0]) for r in sample["resps"]]
        assert sample["acc"] == float(int(np.argmax(lls)) == sample["doc"]["answer"])
