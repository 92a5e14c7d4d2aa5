#!/usr/bin/env python3
"""``clef-quantize-mixed``, for a checkout without the console scripts on PATH: ``python scripts/quantize_mixed.py --help``.

The tool lives in the package: :mod:`clef_vllm.tools.quantize_mixed`.
"""

import sys

from clef_vllm.tools.quantize_mixed import main

if __name__ == "__main__":
    sys.exit(main())
