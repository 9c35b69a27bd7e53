"""Run every benchmark in this folder, one after the other (``make bench``).

Each prints its figures as ratios against baselines measured in the same run; the recorded
figures and exact commands are in docs/benchmarks.md.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

QUICK = "--quick" in sys.argv[1:]


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for script in sorted(here.glob("*.py")):
        if script.name == "run_all.py":
            continue
        cmd = [sys.executable, str(script)]
        if QUICK and "--quick" in script.read_text():
            cmd.append("--quick")
        print(f"\n=== {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nfailed to run: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
