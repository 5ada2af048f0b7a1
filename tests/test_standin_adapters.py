"""The stand-in runner's adapter slots, which the master's adapter tests lean on: a row computed with an adapter
answers the rule's token shifted by 1 + its rank, an empty slot or a base row the rule's own; bad loads refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents.runtime.standin import StandinRunner, standin_tokens
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.lora import AdapterError


def adapter_dir(root, name: str, rank: int):
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}))
    return path


def decode(slots: list[int] | None) -> StepBatch:
    b = 4
    return StepBatch(np.array([5, 6, 7, 8], np.int32), np.arange(b, dtype=np.int32), np.arange(b, dtype=np.int32),
                     np.ones(b, np.int32), np.full(b, 3, np.int32), np.zeros((b, 1), np.int32),
                     lora_slots=None if slots is None else np.array(slots, np.int32))


def test_rows_answer_with_their_slot_s_adapter(tmp_path):
    runner = StandinRunner(1000, lora={"max_loras": 2, "max_lora_rank": 16}, num_layers=2)
    runner.load_adapter(0, str(adapter_dir(tmp_path, "a", 8)))
    runner.load_adapter(1, str(adapter_dir(tmp_path, "b", 16)))
    rule = standin_tokens(decode(None), 1000)
    assert runner.step(decode([-1, 0, 1, 0])).token_ids.tolist() == (rule + [0, 9, 17, 9]).tolist()
    runner.load_adapter(1, None)
    assert runner.step(decode([1, 1, 0, -1])).token_ids.tolist() == (rule + [0, 0, 9, 0]).tolist()
    assert runner.step(decode(None)).token_ids.tolist() == rule.tolist()


def test_loads_that_do_not_fit_are_refused_and_leave_the_slot(tmp_path):
    runner = StandinRunner(1000, lora={"max_loras": 1, "max_lora_rank": 8}, num_layers=2)
    runner.load_adapter(0, str(adapter_dir(tmp_path, "a", 4)))
    with pytest.raises(ValueError, match="max_lora_rank 8"):
        runner.load_adapter(0, str(adapter_dir(tmp_path, "big", 32)))
    with pytest.raises(ValueError, match="not one of the 1 slots"):
        runner.load_adapter(1, str(tmp_path / "a"))
    with pytest.raises(AdapterError):
        runner.load_adapter(0, str(tmp_path / "missing"))
    assert runner.adapter_shifts.tolist() == [5]
