#!/usr/bin/env python3
"""``clef-build-data``, for a checkout without the console scripts on PATH: ``python scripts/build_data.py --help``.

The tool lives in the package: :mod:`clef_vllm.tools.build_data`.
"""

import sys

from clef_vllm.tools.build_data import main

if __name__ == "__main__":
    sys.exit(main())
