#!/usr/bin/env python3
"""``clef-sensitivity-scan``, for a checkout without the console scripts on PATH: ``python scripts/sensitivity_scan.py --help``.

The tool lives in the package: :mod:`clef_vllm.tools.sensitivity_scan`.
"""

import sys

from clef_vllm.tools.sensitivity_scan import main

if __name__ == "__main__":
    sys.exit(main())
