"""The benchmark tools' one harness: child processes, worker results, out-of-memory, and the JSON record.

Every tool in ``tools/`` imports it by name (``import harness``: ``tools/`` is not a package; a tool run as
``python tools/x.py`` has its own folder on ``sys.path``, one imported from elsewhere puts it there first).

The worker protocol: a driver runs each contender in a fresh process (``python tools/x.py --worker SPEC ...``,
built by :func:`worker_command`), so that every one starts with a clean CUDA context and allocator. The worker
prints its figures as one line ``RESULT {json}`` on stdout (:func:`print_result`); :func:`launch_worker` runs it
and returns a :class:`WorkerOutcome` whose ``status`` is one of ``STATUSES``:

  ok       it exited 0 after printing a RESULT line (``result`` holds it)
  oom      its output shows an allocator out of memory (:func:`is_oom`), whatever else happened after
  timeout  it was stopped after ``timeout`` seconds
  failed   anything else (``error`` says how it ended and its exception lines)

A contender that cannot run the model at all is not launched: its row says ``status: unsupported`` and the
``reason`` (:func:`unsupported_row`).

The model: every tool builds ``conf/model/<name>.yaml`` through ``ModelConfig`` (:func:`model_config`, depth cut
with ``--layers``); :func:`model_summary` says what MFU counts (a mixture of experts: its active parameters), and
:func:`set_experts_implementation` gives every contender of a mixture of experts the same Hugging Face experts
kernel.

Every record starts with :func:`record_header` (benchmark, device, torch version, commit, command line,
timestamp, allocator settings) and is written by :func:`write_record`. :func:`commit` is the one rule for the
commit: ``FSL_COMMIT`` if set (the GPU machine's copy of the tree has no .git: pass
``FSL_COMMIT=$(git rev-parse HEAD)`` there), else ``git rev-parse HEAD`` of this checkout, else "unknown".
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fsdp_speedloader.app.sweep_report import STATUSES, is_oom  # noqa: F401 (STATUSES: re-exported) one rule for sweeps and benchmarks

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "RESULT "
_EXCEPTION_LINE = re.compile(r"\w+(Error|Exception)\b:")
# torchrun's failure report (a box of '=' lines naming the error file, the rank, the exit code): what a worker
# printed before it, a SystemExit's message say, is the cause.
_TORCHRUN_REPORT = re.compile(r"^(\[\w+\]\s*)?(=+|-+|error_file:|traceback\s*:|To enable traceback|Failures:|"
                              r"Root Cause|<NO_OTHER_FAILURES>|time\s*:|host\s*:|rank\s*:|exitcode\s*:|\[\d+\]:|"
                              r"[\w./-]+ FAILED)")


# --- the record -------------------------------------------------------------------------------------


def commit() -> str:
    """``FSL_COMMIT`` if set, else ``git rev-parse HEAD`` of this checkout, else "unknown"."""
    if os.environ.get("FSL_COMMIT"):
        return os.environ["FSL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def cpu_name() -> str:
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_name(device: str = "auto") -> str:
    """The first visible GPU's name (``device`` 'auto' or 'cuda'), else the CPU's.

    Asked in a throw-away process unless this one already uses CUDA: a driver that leaves its GPU to its
    workers must not hold a CUDA context while they run.
    """
    if device == "cpu":
        return cpu_name()
    import torch

    if torch.cuda.is_available():
        if torch.cuda.is_initialized():
            return torch.cuda.get_device_name()
        probe = "import torch; print(torch.cuda.get_device_name())"
        name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
        if name:
            return name
    return cpu_name()


def command_line(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """How to run it again from the repository root: ``python tools/x.py ARGS``."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


# The libraries a figure may depend on besides torch (kernels, peers): their versions go into every record, so rows
# measured in different sessions can be told apart by release (Liger's A/B by release, docs/results.md).
RECORDED_PACKAGES = ("transformers", "triton", "liger-kernel", "torchao", "deepspeed", "accelerate", "flexgen")


def package_versions(names: Sequence[str] = RECORDED_PACKAGES) -> dict:
    """{distribution name: installed version, or None}, read from the installed metadata (nothing is imported)."""
    from importlib import metadata

    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def record_header(benchmark: str, script: str, argv: Optional[Sequence[str]] = None, *,
                  device: Optional[str] = None) -> dict:
    """What every record starts with. ``script``: the tool's ``__file__``; ``argv``: its arguments (default
    ``sys.argv[1:]``); ``device``: a description to use instead of :func:`device_name`'s."""
    import torch

    return {"benchmark": benchmark, "device": device or device_name(), "torch": torch.__version__,
            "packages": package_versions(), "commit": commit(), "command": command_line(script, argv),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "boot_id": boot_id(), "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def boot_id() -> Optional[str]:
    """This machine start's id (Linux: a fresh random one at every boot), or None: records whose commands ran on
    separate starts of the GPU machine say so (the protocol's spread over starts, issue 40)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def write_record(path: str | Path, record: dict) -> Path:
    """``record`` as indented JSON at ``path`` (its folder made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


# --- output -------------------------------------------------------------------------------------------


def error_summary(text: str, max_lines: int = 3) -> str:
    """One line: the output's first exception lines (torchrun's ChildFailedError wrapper left out), or, when it
    has none, its last lines before torchrun's failure report (a worker's SystemExit message)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _EXCEPTION_LINE.search(line) and "ChildFailedError" not in line]
    others = [line for line in lines if not _TORCHRUN_REPORT.search(line)] or lines
    picked = list(dict.fromkeys(errors))[:max_lines] if errors else others[-max_lines:]
    return " | ".join(picked)[-1500:] or "no output"


def print_result(result: dict) -> None:
    """The worker's side of the protocol: its figures as the RESULT line."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def parse_result(stdout: str, prefix: str = RESULT_PREFIX) -> Optional[dict]:
    """The last ``prefix`` line of a worker's stdout as a dict (None without one); other lines are noise.
    Raises ``ValueError`` when that line is not a JSON object (cut short, say)."""
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if not lines:
        return None
    try:
        result = json.loads(lines[-1][len(prefix):])
    except json.JSONDecodeError as e:
        raise ValueError(f"unreadable {prefix.strip()} line ({e}): {lines[-1][:200]}") from None
    if not isinstance(result, dict):
        raise ValueError(f"{prefix.strip()} line is not a JSON object: {lines[-1][:200]}")
    return result


# --- processes ---------------------------------------------------------------------------------------


def child_env(env: Optional[dict] = None) -> dict:
    """``env`` (default: this process's) with the checkout first on PYTHONPATH: a child imports this tree's
    package, also where it is not installed."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class Process:
    """A child in its own session (stopping it stops its children too), its stdout and stderr read line by
    line by two threads: kept, and passed to ``echo`` (one line at a time, in arrival order) as they come."""

    def __init__(self, cmd: Sequence[str], *, env: Optional[dict] = None, cwd: Optional[str | Path] = None,
                 echo: Optional[Callable[[str], Any]] = None) -> None:
        self.popen = subprocess.Popen(list(cmd), cwd=cwd, env=child_env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        self.stopped = False
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        lock = threading.Lock()

        def read(stream, kept: list) -> None:
            for line in iter(stream.readline, ""):
                kept.append(line)
                if echo is not None:
                    with lock:
                        echo(line)
            stream.close()

        self._readers = [threading.Thread(target=read, args=(getattr(self.popen, name), kept), daemon=True)
                         for name, kept in self._lines.items()]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """The exit status, or None if it is still running after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its session; SIGKILL after ``grace_s`` seconds if it is still running."""
        if self.popen.poll() is not None:
            return
        self.stopped = True
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:  # gone meanwhile
                break
            if self.wait(wait_s) is not None:
                break

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far; once it has exited, all of it."""
        if self.popen.poll() is not None:
            for reader in self._readers:
                reader.join(timeout=10)  # a grandchild in another session may still hold a pipe
        return "".join(self._lines["stdout"]), "".join(self._lines["stderr"])


@dataclass
class Finished:
    """How a process ended: ``returncode`` None when it was stopped after ``timeout`` seconds."""

    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    timeout: Optional[float] = None

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def failure(self, reason: str = "") -> tuple[str, str]:
        """(status, error) of a run that did not deliver: 'oom' when its output shows an allocator out of
        memory, whatever came after (a rank out of memory can leave its peers waiting in a collective until
        stopped), else 'timeout' or 'failed'; the error says how it ended (plus ``reason``) and its
        exception lines."""
        output = self.stdout + self.stderr
        if self.timed_out:
            how = f"timeout after {self.timeout:g} s"
        elif self.returncode < 0:
            how = f"killed by signal {-self.returncode}"
        else:
            how = f"exit {self.returncode}"
        status = "oom" if is_oom(output) else "timeout" if self.timed_out else "failed"
        return status, f"{how}{' ' + reason if reason else ''}: {error_summary(output)}"


_RUNNING: set = set()  # the children run_process waits on, in any thread (stop_running)
_RUNNING_LOCK = threading.Lock()


def run_process(cmd: Sequence[str], *, env: Optional[dict] = None, cwd: Optional[str | Path] = None,
                timeout: Optional[float] = None, echo: Optional[Callable[[str], Any]] = None) -> Finished:
    """Runs ``cmd`` (a :class:`Process`) to its end, or stops it after ``timeout`` seconds."""
    start = time.perf_counter()
    proc = Process(cmd, env=env, cwd=cwd, echo=echo)
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    try:
        with sigterm_as_exit():
            code = proc.wait(timeout)
    finally:
        proc.stop()  # a timeout, or this process interrupted or terminated: the child's whole session goes
        with _RUNNING_LOCK:
            _RUNNING.discard(proc)
    return Finished(code, *proc.output(), wall_s=time.perf_counter() - start, timeout=timeout)


def stop_running() -> None:
    """Stops every child that run_process waits on in any thread: a driver whose threads run workers side by side
    stops them all when it is interrupted (each child, in its own session, would otherwise run on)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for proc in running:
        proc.stop()


@contextlib.contextmanager
def sigterm_as_exit():
    """In the main thread: a SIGTERM to this process (`timeout`, a scheduler), which would end it at once and leave
    its children running on with the GPU and host memory they hold, raises SystemExit instead, so that the
    ``finally`` blocks that stop them run."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@dataclass
class WorkerOutcome:
    """How a worker ended: ``status`` (one of ``STATUSES``), its RESULT when ok, else ``error``."""

    status: str
    result: Optional[dict]
    error: Optional[str]
    returncode: Optional[int]
    wall_s: float
    output_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def row(self, **fields: Any) -> dict:
        """A record's row: ``fields``, then the worker's result (its keys win), or its status, error and last
        lines of output; then ``status`` and ``wall_s``."""
        if self.ok:
            return {**fields, **self.result, "status": "ok", "wall_s": self.wall_s}
        return {**fields, "status": self.status, "error": self.error, "returncode": self.returncode,
                "output_tail": self.output_tail, "wall_s": self.wall_s}


def launch_worker(cmd: Sequence[str], env: Optional[dict] = None, timeout: Optional[float] = None, *,
                  cwd: Optional[str | Path] = None, echo: Optional[Callable[[str], Any]] = None,
                  tail_lines: int = 30) -> WorkerOutcome:
    """Runs one worker (:func:`run_process`) and classifies how it ended (the module docstring)."""
    done = run_process(cmd, env=env, cwd=cwd, timeout=timeout, echo=echo)
    try:
        result, unreadable = parse_result(done.stdout), None
    except ValueError as e:
        result, unreadable = None, str(e)
    if done.returncode == 0 and result is not None:
        return WorkerOutcome("ok", result, None, 0, done.wall_s)
    reason = f"with an {unreadable}" if unreadable else (
        f"without a {RESULT_PREFIX.strip()} line" if done.returncode == 0 else "")
    status, error = done.failure(reason)
    tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-tail_lines:]
    return WorkerOutcome(status, None, error, done.returncode, done.wall_s, tail)


def worker_command(script: str, spec: str, argv: Sequence[str], *, drop: Sequence[str] = ()) -> list[str]:
    """``python SCRIPT --worker SPEC ARGV``: the driver's own arguments passed on, less the options in ``drop``
    (each with its value, as ``--opt VALUE`` or ``--opt=VALUE``)."""
    passed, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        elif not any(arg.startswith(f"{opt}=") for opt in drop):
            passed.append(arg)
    return [sys.executable, str(script), "--worker", spec, *passed]


def pyplot(tool: str):
    """``matplotlib.pyplot`` on the Agg backend (files only), or None, with a note on stderr, where matplotlib
    is not installed (the records are written all the same)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{tool}: matplotlib is not installed, no plot (pip install -e '.[plots]')", file=sys.stderr)
        return None
    return plt


def save_figure(fig, path: str | Path) -> Path:
    """The figure laid out, written (120 dpi) and closed; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


# --- the model every contender builds -----------------------------------------------------------------

CONF_MODELS = REPO / "conf" / "model"
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")


def conf_model_names() -> list[str]:
    """The model shapes of ``conf/model/`` (the names ``--model`` takes)."""
    return sorted(p.stem for p in CONF_MODELS.glob("*.yaml"))


def model_config(model: str, *, layers: Optional[int] = None, min_positions: int = 0):
    """``conf/model/<model>.yaml`` (or the YAML file at the path ``model``) as a ``ModelConfig`` of fresh weights
    (its ``path`` dropped: a benchmark never reads a checkpoint), with ``layers`` blocks where given (the same
    blocks, fewer of them: every layer's shapes unchanged) and at least ``min_positions`` positions.
    ValueError naming the known shapes when there is no such file."""
    import yaml

    from fsdp_speedloader.models.config import ModelConfig

    file = CONF_MODELS / f"{model}.yaml"
    if not file.is_file():
        file = Path(model)
        if file.suffix not in (".yaml", ".yml") or not file.is_file():
            raise ValueError(f"--model {model!r}: no conf/model/{model}.yaml; choose one of "
                             f"{', '.join(conf_model_names())}, or give the path of a YAML file of ModelConfig fields")
    raw = yaml.safe_load(file.read_text()) or {}
    raw["path"] = None
    if layers:
        raw["num_layers"] = layers
    raw["max_position_embeddings"] = max(raw.get("max_position_embeddings", ModelConfig.max_position_embeddings),
                                         min_positions)
    return ModelConfig(**raw)


def model_summary(cfg, seq_len: int) -> dict:
    """What MFU counts for ``cfg`` (built on the meta device, nothing allocated): parameters, the parameters a token
    multiplies (a mixture of experts: its routed experts only), the model FLOPs per token of its adapter
    (``flops_per_token``: 6 x active non-embedding parameters + attention) and a sentence saying which basis."""
    from fsdp_speedloader.models import build_model, get_adapter

    adapter = get_adapter(build_model(cfg))
    model = adapter.model
    total = sum(p.numel() for p in model.parameters())
    summary = {"name": cfg.name, "family": cfg.family, "num_layers": cfg.num_layers, "params": total,
               "active_params": total, "flops_per_token": adapter.flops_per_token(seq_len),
               "mfu_basis": "all parameters (dense model): 6 x non-embedding parameters + 12 L h s per token"}
    if hasattr(adapter, "num_experts"):
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
        k, e = adapter.num_experts_per_tok, adapter.num_experts
        summary.update(num_experts=e, num_experts_per_tok=k, expert_params=experts,
                       active_params=int(total - experts * (1 - k / e)),
                       mfu_basis=f"active parameters (mixture of experts: {k} of {e} experts per token): "
                                 "6 x active non-embedding parameters + 12 L h s per token")
    return summary


def set_experts_implementation(model, requested: Optional[str]) -> Optional[str]:
    """A mixture of experts' Hugging Face experts kernel (``config._experts_implementation``: 'grouped_mm', the
    transformers 5 default, 'batched_mm' or 'eager'), set to ``requested`` where given; returns the one the model
    runs, or None for a model without such experts (dense families, or a transformers without the switch)."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return None
    if requested and requested != model.config._experts_implementation:
        model.set_experts_implementation(requested)
    return model.config._experts_implementation


def unsupported_row(contender: str, reason: str, **fields: Any) -> dict:
    """A record's row for a contender that cannot run this model: ``status: unsupported`` and why; nothing is
    launched."""
    return {"contender": contender, **fields, "status": "unsupported", "reason": reason}


# --- a worker's own measurements -----------------------------------------------------------------------


def host_peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def profile_summary(run: Callable[[], Any], summarize: Callable[[str, Any], dict]) -> dict:
    """``run()`` under the profiler (host and CUDA activity); returns ``summarize(trace_path, run's value)`` of
    its Chrome trace, which is deleted then: records keep the summary, not the trace."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        value = run()
    fd, trace = tempfile.mkstemp(prefix="fsl_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(trace)
        return summarize(trace, value)
    finally:
        os.remove(trace)
