#!/usr/bin/env python3
"""Write an alpaca-format load-test workload (default ./alpaca_5010.json) from the packaged corpus.

Usage: python scripts/make_workload.py [-o alpaca_5010.json] [-n 5010] [--seed 0] ...  (see --help)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from llm_serving.bench.workload import main

if __name__ == "__main__":
    sys.exit(main())
