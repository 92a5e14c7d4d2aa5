"""Tensor ops one vLLM step spends on head inputs + the head (CPU): bench/results/cpu_head_ops.txt.

    python bench/head_ops.py

The measurement lives in the package: :mod:`clef_vllm.bench.head_ops`.
"""

from clef_vllm.bench.head_ops import main

if __name__ == "__main__":
    main()
