"""For tests/test_ascend_config.py: runs setup_device("Ascend", 3) with MindSpore's set_device recorded instead of
called (no NPU here)."""
import json
import os

import mindspore as ms

from agents.runtime import device

calls = []
ms.set_device = lambda *args: calls.append(list(args))
os.environ.pop("MS_ENABLE_INTERNAL_BOOST", None)
device.setup_device("Ascend", 3)
print(json.dumps({"set_device": calls, "jit_config": ms.get_context("jit_config"),
                  "mode": ms.get_context("mode"), "env": os.environ.get("MS_ENABLE_INTERNAL_BOOST")}))
