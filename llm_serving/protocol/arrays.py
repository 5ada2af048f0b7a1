"""The numpy array types the protocol's steps carry (their dtypes as the shared memory lays them out)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Int32s = npt.NDArray[np.int32]  # token ids, positions, slots, lengths, block tables
Float32s = npt.NDArray[np.float32]  # logprobs, logits, sampling parameters
Bools = npt.NDArray[np.bool_]
Integers = npt.NDArray[np.integer[Any]]  # any integer array (indices, lengths built by callers)
AnyArray = npt.NDArray[Any]
