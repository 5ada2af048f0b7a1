"""For tests/test_ascend_config.py: sets an Ascend agent's device up as the agents do, from the runner config the
master sends for the config given as JSON in argv[1] (empty: setup_device's own defaults), with MindSpore's
set_device recorded instead of called (no NPU here); argv[2], if given, is JSON of variables the user set before."""
import json
import os
import sys

import mindspore as ms

from agents.runtime import device
from llm_serving.config.serving_config import ServingConfig
from llm_serving.engine.wiring import runner_config_dict
from llm_serving.protocol.ascend_env import ASCEND_ENVIRONMENT

calls = []
ms.set_device = lambda *args: calls.append(list(args))
set_context, pool_caps = ms.set_context, []


def recorded(**kwargs):
    """MindSpore ignores max_device_memory unless the device is Ascend or GPU: recorded instead."""
    if "max_device_memory" in kwargs:
        pool_caps.append(kwargs.pop("max_device_memory"))
    set_context(**kwargs)


ms.set_context = recorded
for entry in ASCEND_ENVIRONMENT:
    os.environ.pop(entry.name, None)
os.environ.update(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
if sys.argv[1]:
    fields = runner_config_dict(ServingConfig.from_dict(json.loads(sys.argv[1])))
    device.setup_device("Ascend", 3, fields["device_environment"], fields["max_device_memory"])
else:
    device.setup_device("Ascend", 3)
print(json.dumps({"set_device": calls, "jit_config": ms.get_context("jit_config"), "mode": ms.get_context("mode"),
                  "env": {e.name: os.environ[e.name] for e in ASCEND_ENVIRONMENT if e.name in os.environ},
                  "max_device_memory": pool_caps}))
