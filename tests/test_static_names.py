"""Every name the package uses is defined: GPU-only branches are not run by CI, so an
import dropped in a refactor (it happened: ``envs`` in the CUDA kernel check) would only
show on the GPU machine. pyflakes reads the source without running it."""

import pathlib

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import reporter as pyflakes_reporter  # noqa: E402


class _Collect(pyflakes_reporter.Reporter):
    def __init__(self):
        self.messages: list[str] = []

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        if "undefined name" in str(message):
            self.messages.append(str(message))


def test_no_undefined_names_in_kvflow():
    root = pathlib.Path(__file__).resolve().parents[1] / "kvflow"
    rep = _Collect()
    for path in sorted(root.rglob("*.py")):
        pyflakes_api.check(path.read_text(), str(path), rep)
    assert rep.messages == []
