"""tools/harness.py: the benchmark tools' commit rule, out-of-memory classification, RESULT protocol and worker
launches (real child processes), and the record header every tool writes."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
sys.path.insert(0, str(TOOLS))
import harness  # noqa: E402  (tools/ is not a package)

# Real messages: the caching allocator under a per-process cap (bench/results/scale_*_cap12.json, torch 2.11),
# its older wording, the CUDA runtime's (a pinned host allocation), cuBLAS's workspace, the CPU allocator's
# current and older text, and NCCL's.
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of "
            "139.80 GiB of which 127.00 GiB is free. Including non-PyTorch memory, this process has 12.79 GiB memory "
            "in use. 12.00 GiB allowed; Of the allocated memory 9.83 GiB is allocated by PyTorch, and 1.85 GiB is "
            "reserved by PyTorch but unallocated.")
OOM_MESSAGES = [
    CUDA_OOM,
    "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB.",
    "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity)",
    "torch.AcceleratorError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 281474976710656 bytes. Error code 12 (Cannot allocate memory)",
    "RuntimeError: [enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: not enough memory: you tried to "
    "allocate 1099511627776 bytes.",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, "
    "NCCL version 2.21.5\nLast error:\nCuda failure 'out of memory'",
]
NOT_OOM = [
    "RuntimeError: stand-in failure",
    "ValueError: the pinned host arena needs 130.00 GiB (139586437120 bytes; activations) but the host budget is "
    "120.00 GiB",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: tools/bench_train.py FAILED",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "",
]


# --- the commit and the record -----------------------------------------------------------------------


def test_commit_honours_fsl_commit(monkeypatch):
    monkeypatch.setenv("FSL_COMMIT", "0123abc")
    assert harness.commit() == "0123abc"
    monkeypatch.delenv("FSL_COMMIT")
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    assert harness.commit() == (git.stdout.strip() if git.returncode == 0 else "unknown")


def test_commit_unknown_without_git(monkeypatch, tmp_path):
    monkeypatch.delenv("FSL_COMMIT", raising=False)
    monkeypatch.setattr(harness, "REPO", tmp_path)  # not a checkout (the GPU machine's copy of the tree)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git must not find a checkout above it
    assert harness.commit() == "unknown"
    monkeypatch.setenv("PATH", "")  # no git at all
    assert harness.commit() == "unknown"


def test_record_header_and_write_record(monkeypatch, tmp_path):
    monkeypatch.setenv("FSL_COMMIT", "feedbeef")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    header = harness.record_header("train", str(TOOLS / "bench_train.py"), ["--model", "llama2_7b", "--name", "a b"],
                                   device="cpu")
    assert header["benchmark"] == "train" and header["device"] == "cpu" and header["torch"] == torch.__version__
    assert header["commit"] == "feedbeef"
    assert header["command"] == "python tools/bench_train.py --model llama2_7b --name 'a b'"  # runnable again
    assert header["pytorch_cuda_alloc_conf"] == "expandable_segments:True"
    boot = Path("/proc/sys/kernel/random/boot_id")
    assert header["boot_id"] == (boot.read_text().strip() if boot.is_file() else None)  # this machine start
    import transformers

    assert header["packages"]["transformers"] == transformers.__version__  # the installed metadata
    assert set(header["packages"]) == set(harness.RECORDED_PACKAGES)
    age = time.time() - datetime.datetime.fromisoformat(header["timestamp"]).timestamp()
    assert 0 <= age < 60
    path = harness.write_record(tmp_path / "new" / "dir" / "r.json", {**header, "results": [{"x": 1.5}]})
    assert path.read_text().endswith("\n") and json.loads(path.read_text())["results"] == [{"x": 1.5}]
    if not torch.cuda.is_available():
        assert harness.device_name().startswith("cpu (") and harness.device_name("cpu").startswith("cpu (")


# --- out of memory, output -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", OOM_MESSAGES)
def test_is_oom_on_real_messages(text):
    assert harness.is_oom(f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{text}\n")


@pytest.mark.parametrize("text", NOT_OOM)
def test_is_oom_not_on_other_failures(text):
    assert not harness.is_oom(text)


def test_is_oom_of_a_real_cpu_allocation_failure():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: refused by the CPU allocator, not by a size check
    assert harness.is_oom(f"{type(info.value).__name__}: {info.value}"), str(info.value)


def test_parse_result_among_noise():
    stdout = "\n".join([
        "loading model ...",
        'RESULT {"tokens_per_s": 1.0}',  # an earlier result: the last one counts
        "[rank0]: RESULT {\"tokens_per_s\": 99}",  # not at the start of its line: noise
        "  RESULT indented",
        'RESULT {"tokens_per_s": 2.5, "contender": "speedloader"}',
        "W1123 teardown warning",
    ])
    assert harness.parse_result(stdout) == {"tokens_per_s": 2.5, "contender": "speedloader"}
    assert harness.parse_result("no result here\nRESULTS are below\n") is None
    assert harness.parse_result("PLAN {\"n\": 2}", prefix="PLAN ") == {"n": 2}
    with pytest.raises(ValueError, match="unreadable RESULT line"):
        harness.parse_result('RESULT {"tokens_per_s": 2.')  # cut short
    with pytest.raises(ValueError, match="not a JSON object"):
        harness.parse_result("RESULT [1, 2]")


def test_error_summary_prefers_exception_lines():
    output = "\n".join(["step 1", "Traceback (most recent call last):", '  File "w.py", line 3, in <module>',
                        CUDA_OOM, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: x FAILED",
                        CUDA_OOM, "last line"])
    assert harness.error_summary(output) == CUDA_OOM  # once, without torchrun's wrapper
    assert harness.error_summary("a\nb\n\nc\nd\n") == "b | c | d"
    assert harness.error_summary("") == "no output"


def test_error_summary_finds_a_workers_exit_message_above_torchruns_report():
    output = """[node0] deepspeed-offload: ZeRO-3 offload needs about 211 GiB of host memory (raise the limit)
[node0] E1126 13:20:01 failed (exitcode: 1) local_rank: 0 (pid: 81) of binary: python3
[node0] ============================================================
[node0] /work/tools/bench_train.py FAILED
[node0] ------------------------------------------------------------
[node0] Failures:
[node0]   <NO_OTHER_FAILURES>
[node0] ------------------------------------------------------------
[node0] Root Cause (first observed failure):
[node0] [0]:
[node0]   time      : 2026-11-26_13:20:01
[node0]   host      : gpu-host
[node0]   rank      : 0 (local_rank: 0)
[node0]   exitcode  : 1 (pid: 81)
[node0]   error_file: <N/A>
[node0]   traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
[node0] ============================================================
"""
    summary = harness.error_summary(output)
    assert "needs about 211 GiB of host memory" in summary and "error_file" not in summary


def test_worker_command_passes_the_drivers_arguments_on():
    argv = ["--model", "llama2_7b", "--contender", "speedloader:1x8", "--contender=ondevice:1x8", "--steps", "3",
            "--out-dir", "/tmp/a:b"]
    assert harness.worker_command("tools/bench_train.py", "fsdp2-offload:2x4", argv, drop=("--contender",)) == [
        sys.executable, "tools/bench_train.py", "--worker", "fsdp2-offload:2x4", "--model", "llama2_7b", "--steps",
        "3", "--out-dir", "/tmp/a:b"]


# --- real worker processes ---------------------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_launch_worker_ok(tmp_path):
    outcome = harness.launch_worker(_python("""
        import json, os, sys
        print("warming up", flush=True)
        print("a warning", file=sys.stderr)
        print("RESULT " + json.dumps({"tokens_per_s": 123.5, "env": os.environ["FSL_TEST"],
                                      "path0": os.environ["PYTHONPATH"].split(os.pathsep)[0]}))
        print("teardown noise")
    """), env={"PATH": "/usr/bin:/bin", "FSL_TEST": "passed"}, timeout=60)
    assert outcome.status == "ok" and outcome.ok and outcome.returncode == 0 and outcome.error is None
    assert outcome.result == {"tokens_per_s": 123.5, "env": "passed", "path0": str(REPO)}  # the checkout first
    row = outcome.row(contender="speedloader:1x8")
    assert row["contender"] == "speedloader:1x8" and row["tokens_per_s"] == 123.5 and row["status"] == "ok"
    assert row["wall_s"] == outcome.wall_s > 0


def test_launch_worker_cuda_oom_is_oom():
    outcome = harness.launch_worker(_python(f"""
        import sys
        print("step 1", flush=True)
        print("Traceback (most recent call last):", file=sys.stderr)
        print({CUDA_OOM!r}, file=sys.stderr)
        sys.exit(1)
    """), timeout=60)
    assert outcome.status == "oom" and outcome.result is None and outcome.returncode == 1
    assert outcome.error.startswith("exit 1: torch.OutOfMemoryError: CUDA out of memory.")
    row = outcome.row(contender="fsdp2-offload:8x8")
    assert row["status"] == "oom" and row["error"] == outcome.error and row["output_tail"][0] == "step 1"


def test_launch_worker_real_cpu_oom_is_oom():
    outcome = harness.launch_worker(_python("""
        import torch
        torch.empty(2**62, dtype=torch.uint8)
    """), timeout=120)
    assert outcome.status == "oom" and outcome.returncode == 1, outcome.error


def test_launch_worker_failures():
    failed = harness.launch_worker(_python('raise RuntimeError("stand-in failure")'), timeout=60)
    assert failed.status == "failed" and failed.error == "exit 1: RuntimeError: stand-in failure"
    silent = harness.launch_worker(_python('print("done")'), timeout=60)
    assert silent.status == "failed" and silent.error == "exit 0 without a RESULT line: done"
    cut = harness.launch_worker(_python('print("RESULT {\\"x\\": ")'), timeout=60)
    assert cut.status == "failed" and "unreadable RESULT line" in cut.error
    # A RESULT line does not make a crashed worker ok.
    crashed = harness.launch_worker(_python('import os; print("RESULT {}", flush=True); os.abort()'), timeout=60)
    assert crashed.status == "failed" and crashed.error.startswith("killed by signal 6")


def test_launch_worker_timeout_stops_the_whole_session(tmp_path):
    marker = tmp_path / "grandchild_alive"
    start = time.monotonic()
    outcome = harness.launch_worker(_python(f"""
        import subprocess, sys, time
        # A grandchild (as a compile worker or a DataLoader would be): the timeout must stop it too.
        subprocess.Popen([sys.executable, "-c", "import time, pathlib; time.sleep(4); "
                          "pathlib.Path({str(marker)!r}).write_text('x')"])
        print("working", flush=True)
        time.sleep(60)
    """), timeout=1.5)
    assert outcome.status == "timeout" and outcome.returncode is None
    assert outcome.error == "timeout after 1.5 s: working"
    assert time.monotonic() - start < 30
    time.sleep(4)
    assert not marker.exists()


def test_a_terminated_driver_stops_its_worker(tmp_path):
    """``timeout`` or a scheduler sends the driver SIGTERM: its worker (in its own session) must not run on."""
    marker = tmp_path / "worker_alive"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TOOLS)!r})
        import harness
        print("driver up", flush=True)
        harness.run_process([sys.executable, "-c", "import time, pathlib; time.sleep(5); "
                             "pathlib.Path({str(marker)!r}).write_text('x')"], timeout=60)
    """)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "driver up"
    time.sleep(1.0)  # the worker has started
    driver.terminate()
    assert driver.wait(timeout=30) == 128 + 15  # it stopped its worker, then exited
    time.sleep(6)
    assert not marker.exists()


def test_a_terminated_driver_stops_the_workers_its_threads_run(tmp_path):
    """bench_fair --gpus: workers run from threads (no SIGTERM handler there); the driver's main thread turns SIGTERM
    into an exit, stops every running worker (stop_running), and none runs on."""
    markers = [tmp_path / f"worker_{i}_alive" for i in range(2)]
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(TOOLS)!r})
        import harness
        def work(marker):
            harness.run_process([sys.executable, "-c", "import time, pathlib; time.sleep(5); "
                                 f"pathlib.Path({{marker!r}}).write_text('x')"], timeout=60)
        threads = [threading.Thread(target=work, args=(m,), daemon=True) for m in {[str(m) for m in markers]!r}]
        for t in threads:
            t.start()
        print("driver up", flush=True)
        with harness.sigterm_as_exit():
            try:
                for t in threads:
                    t.join()
            except BaseException:
                harness.stop_running()
                raise
    """)], stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline().strip() == "driver up"
    time.sleep(1.0)  # the workers have started
    driver.terminate()
    assert driver.wait(timeout=30) == 128 + 15
    time.sleep(6)
    assert not any(m.exists() for m in markers)


def test_launch_worker_oom_before_a_hang_is_oom():
    """A rank out of memory can leave its peers waiting in a collective until stopped: still oom."""
    outcome = harness.launch_worker(_python(f"""
        import sys, time
        print({CUDA_OOM!r}, file=sys.stderr, flush=True)
        time.sleep(60)
    """), timeout=1.5)
    assert outcome.status == "oom" and outcome.error.startswith("timeout after 1.5 s: torch.OutOfMemoryError")


def test_run_process_echoes_every_line():
    lines: list[str] = []
    done = harness.run_process(_python("""
        import sys
        for i in range(3):
            print(f"out {i}", flush=True)
            print(f"err {i}", file=sys.stderr, flush=True)
    """), timeout=60, echo=lines.append)
    assert done.returncode == 0 and not done.timed_out
    assert done.stdout == "out 0\nout 1\nout 2\n" and done.stderr == "err 0\nerr 1\nerr 2\n"
    assert sorted(lines) == sorted(done.stdout.splitlines(True) + done.stderr.splitlines(True))
