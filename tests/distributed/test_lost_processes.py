"""No orphans, no hangs: a hard-killed trainer takes its checkpoint helpers with it (also a
writer caught mid-save), and under torchrun a dead or stalled rank ends the job with one
line naming it (--distributed-timeout-minutes for the stalled one)."""

import os
import signal
import time

import psutil

from pretrain_runner import (FAST_ARGS, REPO, free_port, kill_group, logged_steps,
                             start_in_group, torchrun_worker, wait_for)

STUCK_WRITER = """
import os, sys, time
if __name__ == "__main__":  # the writer's helper processes re-import this file
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    def stuck(*args, **kwargs):  # runs in each forked writer: never finishes its bucket
        open(os.path.join(os.environ["WRITER_PIDS"], str(os.getpid())), "w").close()
        time.sleep(600)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(stuck)
    from megatron_ext.training.pretrain import main
    sys.exit(main("llama"))
"""


def _session(pid: int) -> list[psutil.Process]:
    """Every live process of session ``pid`` (the trainer and whatever it started)."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(proc.pid) == pid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def test_helpers_die_with_a_killed_trainer(tmp_path, monkeypatch):
    script, pids = tmp_path / "stuck_writer.py", tmp_path / "writers"
    script.write_text(STUCK_WRITER)
    pids.mkdir()
    monkeypatch.setenv("WRITER_PIDS", str(pids))
    proc = start_in_group([str(script), *FAST_ARGS, "--train-iters", "2", "--save",
                           str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run")],
                          tmp_path / "run.log")
    try:
        wait_for(lambda: len(list(pids.iterdir())) >= 1, proc)  # a writer is mid-save
        helpers = [p for p in _session(proc.pid) if p.pid != proc.pid]
        names = " ".join(" ".join(p.cmdline()) for p in helpers)
        assert "spawn_main" in names and "resource_tracker" in names, names
        os.kill(proc.pid, signal.SIGKILL)  # the trainer only, like the OOM killer
        proc.wait()
        deadline = time.time() + 20
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.1)
        left = [" ".join(p.cmdline())[:80] for p in _session(proc.pid)]
    finally:
        kill_group(proc)
    assert not left, f"orphaned helper processes: {left}"


def _torchrun(tmp_path, *extra):
    run_dir = tmp_path / "run"
    proc = start_in_group(["-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(REPO / "pretrain_llama.py"),
                           *FAST_ARGS, "--train-iters", "1000", "--no-save",
                           "--run-dir", str(run_dir), *extra], tmp_path / "run.log")
    rank1 = torchrun_worker(proc.pid, 1)
    wait_for(lambda: logged_steps(run_dir) >= 2, proc)
    return proc, rank1


def _errors(tmp_path) -> list[str]:
    log = (tmp_path / "run.log").read_text()
    assert "[rank0]: Traceback" not in log and "[rank0]:" not in log, log[-3000:]
    return [line for line in log.splitlines() if line.startswith("error:")]


def test_dead_peer_is_one_line_naming_it(tmp_path):
    proc, rank1 = _torchrun(tmp_path)
    try:
        rank1.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        kill_group(proc)
    assert _errors(tmp_path) == ["error: lost rank 1 (its process ended); stopping this rank "
                                 "(resume from the last checkpoint with --load)"]


def test_stalled_peer_ends_after_the_timeout(tmp_path):
    proc, rank1 = _torchrun(tmp_path, "--distributed-timeout-minutes", "0.1")
    try:
        rank1.send_signal(signal.SIGSTOP)
        start = time.time()
        wait_for(lambda: "error:" in (tmp_path / "run.log").read_text(), proc, seconds=60)
        waited = time.time() - start
    finally:
        rank1.kill()  # its own session (torchrun's workers): kill_group would miss it
        kill_group(proc)
    assert 6 - 1 <= waited < 40  # 0.1 min = 6 s, plus the step in flight
    assert _errors(tmp_path) == ["error: rank 1 stopped (its process is suspended): no answer "
                                 "within --distributed-timeout-minutes 0.1; stopping this rank "
                                 "(resume from the last checkpoint with --load)"]
