#!/usr/bin/env python3
"""Contest-compatible load test: python scripts/test_serving_performance.py -X 1 -P 8000 -O out -T 60.

Same flags as the contest's script (plus --endpoint, --arrival, --num-prompts, ...; see --help); the logic
lives in the loadtest package, which ``llm-serving bench`` also runs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from loadtest.cli import main

if __name__ == "__main__":
    sys.exit(main())
