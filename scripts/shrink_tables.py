#!/usr/bin/env python3
"""``clef-shrink-tables``, for a checkout without the console scripts on PATH: ``python scripts/shrink_tables.py --help``.

The tool lives in the package: :mod:`clef_vllm.tools.shrink_tables`.
"""

import sys

from clef_vllm.tools.shrink_tables import main

if __name__ == "__main__":
    sys.exit(main())
