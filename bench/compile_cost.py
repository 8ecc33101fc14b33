"""What loading the kernel backend costs the agent at start, by the headers
bcc compiles against: the bundled ones (bpf/include/, the default) and the
distribution's (`--kernel-headers installed`).

Each run is a fresh process, as an agent's start is: it imports the sampler,
loads the backend (a child compiles, loads and attaches) and reports the
load's time, the imports', the whole process's from exec to exit, its peak
resident memory (VmHWM) and the compiling child's. Prints medians of --runs.

Needs root and bcc; `installed` needs /lib/modules/$(uname -r)/build. Not a
test: no thresholds.

    .venv/bin/python bench/compile_cost.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, time
t0 = time.monotonic()
from pathlib import Path
from sampler.kernel import sched
t1 = time.monotonic()
sampler = sched.load(Path("/proc"), kernel_headers=sys.argv[1] or None)
t2 = time.monotonic()
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "peak_kib": hwm,
                  "loader_peak_kib": sampler.programs.loader_peak_kib}), flush=True)
sampler.close()
"""


def one_start(headers: str) -> dict[str, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, headers], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"})  # fmt: skip
    figures = json.loads(out.stdout.splitlines()[-1])
    figures["process_s"] = time.monotonic() - start  # exec, imports, load, close and exit
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    kinds = ["bundled"]
    if Path(f"/lib/modules/{os.uname().release}/build").exists():
        kinds.append("installed")
    else:
        print(f"no headers installed for {os.uname().release}: the bundled headers only")
    one_start("")  # warm the page cache: every run then reads the same files from memory
    print(f"{'headers':<10} {'load s':>8} {'imports s':>10} {'process s':>10} {'peak MiB':>9} {'compiler MiB':>13}",
          end="")  # fmt: skip
    print(f"  (medians of {args.runs})")
    for kind in kinds:
        runs = [one_start("" if kind == "bundled" else kind) for _ in range(args.runs)]

        def median(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        print(f"{kind:<10} {median('load_s'):>8.3f} {median('import_s'):>10.3f} {median('process_s'):>10.3f} "
              f"{median('peak_kib') / 1024:>9.1f} {median('loader_peak_kib') / 1024:>13.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
