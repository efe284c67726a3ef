"""Measurement helpers of the benches: a command run in a child process (wall time, CPU time and the
child's own peak RSS), and the name of this machine's CPU."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run CMD with its output in LOG; raise with the log's tail when it fails.

    The peak RSS comes from ``os.wait4``: the child's alone, not the caller's."""
    start = time.time()
    load_before = os.getloadavg()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{log.read_text()[-4000:]}")
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


def cpu_name() -> str | None:
    """/proc/cpuinfo's model name, or None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
