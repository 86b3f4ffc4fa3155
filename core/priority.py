"""The serving processes run at normal priority, not at Ray's worker niceness.

Ray starts every worker process at nice 15 (its `worker_niceness`), so a replica's engine threads and the
Ingress's HTTP thread lose the CPU to any nice-0 process on the node (a client, the raylet, a log shipper):
on 2 cores, measured with bench/peers/peers.sh, the same engine prefilled ~12% slower in a nice-15 replica than
in a nice-0 process, and every OpenMP barrier waited on a preempted thread. The serving path then runs
at nice 0, as the engine does in-process; Ray's own control plane is unaffected.

Linux keeps a nice value per thread, and a thread inherits its creator's: every thread of the process is
reset here, before the engine's step thread (and its OpenMP pool) or the front door exists. Raising the
priority needs root or CAP_SYS_NICE; without it this logs how to start Ray instead
(`RAY_worker_niceness=0`, which the Makefile and k8s/rayservice.yaml set).
"""

import logging
import os

logger = logging.getLogger("ray.serve")

NORMAL_NICENESS = 0


def run_at_normal_priority(who: str) -> int:
    """Sets every thread of this process that runs above nice 0 to nice 0 -> the highest niceness seen."""
    highest = NORMAL_NICENESS
    try:
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)  # per thread on Linux
                if nice > NORMAL_NICENESS:
                    highest = max(highest, nice)
                    os.setpriority(os.PRIO_PROCESS, tid, NORMAL_NICENESS)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except PermissionError:
        logger.warning("%s runs at nice %d (Ray's worker_niceness) and may not lower it: its threads lose "
                       "the CPU to every nice-0 process. Start Ray with RAY_worker_niceness=0.", who, highest)
        return highest
    if highest > NORMAL_NICENESS:
        logger.info("%s: nice %d -> %d (Ray's worker niceness would slow the serving path)", who, highest,
                    NORMAL_NICENESS)
    return highest
