#!/usr/bin/env python3
"""``clef-load``, for a checkout without the console scripts on PATH: ``python scripts/clef_load.py --help``.

The tool lives in the package: :mod:`clef_vllm.tools.clef_load`.
"""

import sys

from clef_vllm.tools.clef_load import main

if __name__ == "__main__":
    sys.exit(main())
