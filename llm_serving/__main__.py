"""``python -m llm_serving`` is the ``llm-serving`` command."""

import sys

from llm_serving.cli.main import main

sys.exit(main())
