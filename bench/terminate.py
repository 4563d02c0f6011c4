"""How long a run takes to stop on SIGTERM in the middle of a forward pass, on a big model.

    python bench/terminate.py [--size 265m] [--keep DIR]

Builds the Llama of ``bench/certify.py``'s ``--size``, starts ``precision-convert model SRC
--to bf16-safe`` on it, waits until its first probe forward has finished (the forward ledger's
first line: calibration is now running forward after forward), waits ``--after`` seconds
more, sends SIGTERM and times the exit. Schedulers send SIGKILL about 30 s after SIGTERM; the
command should be gone well before (the target: 10 s). Prints one JSON object: the seconds,
the exit code (143 expected), its last line on stderr and what was left beside the target.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from certify import LEDGER, SIZES, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="265m")
    parser.add_argument("--after", type=float, default=0.5, help="seconds after a forward")
    parser.add_argument("--keep", type=Path, help="build the source here and keep it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="pc-terminate-"))
    try:
        source, _ = build(root, args.size)
        output = root / "out"
        ledger = root / "ledger.jsonl"
        ledger.unlink(missing_ok=True)
        command = shutil.which("precision-convert", path=str(Path(sys.executable).parent))
        argv = [str(command), "model", str(source), "--to", "bf16-safe", "-o", str(output)]
        env = {**os.environ, LEDGER: str(ledger)}
        child = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
        )
        lines: list[tuple[float, str]] = []  # each line on stderr, with when it came
        reader = threading.Thread(
            target=lambda: lines.extend((time.perf_counter(), line) for line in child.stderr or ())
        )
        reader.start()
        while child.poll() is None and not (ledger.exists() and ledger.stat().st_size):
            time.sleep(0.05)
        time.sleep(args.after)
        running = child.poll() is None
        sent = time.perf_counter()
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=60)
        seconds = time.perf_counter() - sent
        reader.join()
        said = next((at - sent for at, line in lines if at >= sent and "interrupted" in line), None)
        beside = sorted(p.name for p in root.iterdir() if p.name.startswith(".out."))
        print(
            json.dumps(
                {
                    "size": args.size,
                    "signalled_while_running": running,
                    "seconds_to_exit": round(seconds, 3),
                    "seconds_to_its_line": None if said is None else round(said, 3),
                    "exit_code": code,
                    "last_line": lines[-1][1].strip() if lines else "",
                    "left_beside_target": beside,
                    "target_exists": output.exists(),
                },
                indent=2,
            )
        )
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
