"""Small helpers shared across the package (no torch: kvflow.core imports these)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: how many ``b``-sized pieces cover ``a``."""
    return -(-a // b)


def describe_exit(who: str, returncode: int) -> str:
    """How a child process ended, for an error message: ``who`` was killed by SIGKILL,
    or exited with code N."""
    import signal

    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{who} was killed by {name}"
    return f"{who} exited with code {returncode}"
