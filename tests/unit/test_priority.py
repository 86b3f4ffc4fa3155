"""core/priority.py: a process Ray started at nice 15 gets every thread back to nice 0 (where allowed)."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import os, threading
from core.priority import run_at_normal_priority
os.nice(7)  # this thread, as Ray's worker_niceness leaves a worker's threads
ready, done = threading.Event(), threading.Event()
def idle():
    ready.set()
    done.wait()
thread = threading.Thread(target=idle)
thread.start()  # a thread made before: it inherited nice 7
ready.wait()
before = sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
highest = run_at_normal_priority("probe")
after = sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
done.set()
import json
print(json.dumps([before, highest, after]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a thread's niceness needs root or CAP_SYS_NICE")
def test_every_thread_of_a_niced_process_is_reset_to_nice_0():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, highest, after = json.loads(out)
    assert before == [7, 7] and highest == 7 and after == [0, 0]


def test_a_process_at_nice_0_is_left_alone():
    from core.priority import run_at_normal_priority

    assert os.getpriority(os.PRIO_PROCESS, 0) == 0
    assert run_at_normal_priority("test") == 0
