"""Thread stacks on demand (clef_vllm.util.stacks) and the bounded warm-up step that uses them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from clef_vllm.backends.vllm_backend import EngineError, bounded_warmup_step
from clef_vllm.util.stacks import catches

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1") or not os.path.exists("/proc/self/status"),
                                reason="SIGUSR1 and /proc are Linux features")

CHILD = """
import sys, time
from clef_vllm.util.stacks import enable_stack_dumps
assert enable_stack_dumps()
def stuck_in_the_engine():
    print("ready", flush=True)
    time.sleep(60)
stuck_in_the_engine()
"""


def _child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if code == CHILD:
        assert proc.stdout.readline().strip() == "ready"
    return proc


def _finish(proc: subprocess.Popen) -> str:
    proc.kill()
    return proc.communicate(timeout=30)[1]


def test_a_stuck_warm_up_step_fails_naming_it_and_the_engine_dumps_its_stacks():
    """Past its limit a warm-up step raises EngineError naming the step; every descendant that catches
    SIGUSR1 writes its threads' stacks (here: the function it is stuck in); a descendant without a handler
    (which SIGUSR1 would kill) is left alone."""
    engine, bystander = _child(CHILD), _child("import time; time.sleep(60)")
    try:
        time.sleep(0.5)
        assert catches(engine.pid, signal.SIGUSR1) and not catches(bystander.pid, signal.SIGUSR1)
        with pytest.raises(EngineError, match=r"warm-up: a 640-token prompt did not finish within 0 s") as err:
            asyncio.run(bounded_warmup_step("a 640-token prompt", asyncio.sleep(30), timeout_s=0.3))
        assert str(engine.pid) in str(err.value)
        time.sleep(0.5)
        assert bystander.poll() is None                      # not signalled, still alive
    finally:
        stderr, _ = _finish(engine), _finish(bystander)
    assert "most recent call first" in stderr and "in stuck_in_the_engine" in stderr


def test_a_warm_up_step_in_time_returns_its_value():
    async def step():
        return 42
    assert asyncio.run(bounded_warmup_step("a 17-token prompt", step(), timeout_s=5)) == 42


def test_a_failed_warm_up_step_names_itself():
    """A warm-up answer the engine got wrong says which warm-up step it was (a GPU run's
    "engine returned 9 values for 9 options" said neither the step nor what was wrong)."""
    async def step():
        raise EngineError("engine returned non-finite values for 9 of 9 options")
    with pytest.raises(EngineError, match=r"^warm-up: a batch of 3 prompts \(\[97, 256, 411\] tokens\): engine "
                                          r"returned non-finite values for 9 of 9 options$"):
        asyncio.run(bounded_warmup_step("a batch of 3 prompts ([97, 256, 411] tokens)", step(), timeout_s=5))
