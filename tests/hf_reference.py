"""Hugging Face transformers as the independent reference for greedy generation."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM


def load_hf(model_dir: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return model.eval()


def hf_greedy(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int,
              eos_token_id: int | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-softmax values from ``generate(do_sample=False)``."""
    with torch.no_grad():
        res = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=eos_token_id,
                             pad_token_id=0)
    tokens = res.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(score[0].double(), -1)[t].item() for score, t in zip(res.scores, tokens)]
    return tokens, logprobs


def hf_last_logits(model: LlamaForCausalLM, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0, -1]


def check_greedy_near(hf: LlamaForCausalLM, prompt_ids: list[int], got: list[int], got_logprobs: list[float],
                      tie: float, logprob_atol: float) -> bool:
    """Greedy ids of a reduced-precision run against Hugging Face in that precision (``hf``): equal, or first
    different only where Hugging Face's own logits of its token and ours are within ``tie`` (a near-tie the
    rounding may flip); logprobs within ``logprob_atol`` before any difference. Returns whether all ids were
    equal; asserts the rest."""
    ref, ref_logprobs = hf_greedy(hf, prompt_ids, len(got))
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    for i in range(first):
        assert abs(got_logprobs[i] - ref_logprobs[i]) <= logprob_atol, (prompt_ids, i)
    if first < len(ref):
        logits = model_logits(hf, prompt_ids + ref[:first])
        assert float(logits[ref[first]] - logits[got[first]]) <= tie, (prompt_ids, first)
    return first == len(ref)


def model_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """float32 logits of the last position."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()
