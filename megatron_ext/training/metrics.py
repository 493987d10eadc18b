"""Where numbers go: ``<run-dir>/metrics.jsonl``, TensorBoard, and a console progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from megatron_ext.io import read_jsonl, write_text_atomic


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def drop_records_after(path: str, step: int) -> None:
    """A resume that logs into its run folder again (``--load`` of a save root): the records
    of steps after the checkpoint's (logged before the run stopped) go; the resume logs those
    steps anew, so each step is in the file once."""
    if not os.path.isfile(path):
        return
    records = read_jsonl(path)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) < len(records):
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class MetricsLogger:
    """Writes every record to metrics.jsonl (flushed per line) and TensorBoard; prints progress.

    Only the rank that owns the logger writes; build it on global rank 0 and pass ``None``
    elsewhere.
    """

    def __init__(self, run_dir: str, train_iters: int, tensorboard_dir: str | None = None,
                 resumed_at: int | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resumed_at is not None:
            drop_records_after(self.path, resumed_at)
        self._file = open(self.path, "a", encoding="utf-8")
        self.train_iters = train_iters
        self._tty = sys.stdout.isatty()
        self._start = time.time()
        self._start_step: int | None = None
        self._tb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def eta(self, step: int) -> str:
        if self._start_step is None:
            self._start_step, self._start = step, time.time()
            return "--:--"
        done = step - self._start_step
        rate = (time.time() - self._start) / max(done, 1)
        return format_duration(rate * (self.train_iters - step))

    def train_step(self, record: dict) -> None:
        self.write(record)
        line = (f"step {record['step']:>6}/{self.train_iters} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.3e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s'] * 1e3:.0f} ms/step"
                f" | ETA {self.eta(record['step'])}")
        if "mem_gib" in record:
            line += f" | mem {record['mem_gib']:.1f} GiB"
        print(line, flush=True)

    def validation(self, record: dict) -> None:
        self.write(record)
        print(f"validation at step {record['step']}: loss {record['val_loss']:.4f} | "
              f"ppl {record['val_ppl']:.2f}", flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
