"""What a benchmark result records about where and how it ran."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time


def git_commit() -> str:
    from kvflow import envs

    if envs.git_commit():
        return envs.git_commit()
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        sha = proc.stdout.strip() if proc.returncode == 0 else ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        # The machine may be shared: the load says how much else was running.
        "loadavg": list(os.getloadavg()),
    }
    try:  # a serving benchmark's client may run without torch
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
            info["driver"] = out.splitlines()[0] if out else None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# The arguments ``kvflow.cli.main(argv)`` was called with in-process (tests, scripts),
# which sys.argv does not hold.
cli_argv: list[str] | None = None


def invocation() -> str:
    """This process's command line as a user would type it: ``python benchmarks/x.py ...``
    for a script of the repository's benchmarks/ or scripts/, else ``kvflow ...`` (the
    CLI, also when its ``main`` is called in-process)."""
    if cli_argv is not None:
        return f"kvflow {' '.join(shlex.quote(a) for a in cli_argv)}".rstrip()
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    prog = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for folder in ("benchmarks", "scripts"):
        if prog.startswith(os.path.join(repo, folder) + os.sep):
            return f"python {os.path.relpath(prog, repo)} {args}".rstrip()
    return f"kvflow {args}".rstrip()


def save_result(path: str | None, result: dict) -> dict:
    """Stamp a benchmark result with the exact command, commit, machine and date, and
    write it as JSON to ``path`` (when given). Returns the stamped result."""
    result = {"command": invocation(), "commit": git_commit(), "machine": machine_info(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "loadavg": os.getloadavg(),
              # kvflow's switches (KVFLOW_GEMV, KVFLOW_WOQ_GEMV, ...): A/B runs differ here
              "kvflow_env": {k: v for k, v in sorted(os.environ.items())
                             if k.startswith("KVFLOW_") and k != "KVFLOW_GIT_COMMIT"},
              **result}
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {path}")
    return result
