"""``kvflow chat --url URL``: an interactive chat with a running OpenAI-compatible server,
streaming each reply as it is generated (standard library only)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable

from kvflow import envs
from kvflow.entrypoints.utils import normalize_base_url


class ServerError(Exception):
    pass


def _request(url: str, api_key: str | None, body: dict | None = None,
             timeout: float = 600.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise ServerError(_error_message(e.read(), e.code)) from None
    except urllib.error.URLError as e:
        raise ServerError(f"cannot reach {url}: {e.reason}") from None


def _error_message(raw: bytes, status: int | None = None) -> str:
    try:
        err = json.loads(raw)["error"]
        return f"{status or ''} {err.get('message')}".strip()
    except (ValueError, KeyError, TypeError):
        return f"{status or ''} {raw[:200]!r}".strip()


def pick_model(base: str, api_key: str | None, wanted: str | None) -> str:
    """``wanted`` if the server serves it, else the server's first model."""
    with _request(f"{base}/v1/models", api_key, timeout=30) as resp:
        ids = [m["id"] for m in json.load(resp)["data"]]
    if not ids:
        raise ServerError("the server lists no models")
    return wanted if wanted in ids else ids[0]


def stream_reply(base: str, api_key: str | None, body: dict, out=sys.stdout) -> str:
    """POST a streaming chat completion; print and return the reply text."""
    parts: list[str] = []
    with _request(f"{base}/v1/chat/completions", api_key, {**body, "stream": True}) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(_error_message(data.encode()))
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    parts.append(text)
                    out.write(text)
                    out.flush()
    out.write("\n")
    return "".join(parts)


def chat_with_server(ns: argparse.Namespace) -> int:
    base = normalize_base_url(ns.url)
    api_key = ns.api_key or envs.api_key()
    try:
        model = pick_model(base, api_key, getattr(ns, "model_flag", None) or ns.model)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Flags left unset are left out: the server's defaults apply, as they do here.
    params = {"model": model, "max_tokens": ns.max_tokens, "temperature": ns.temperature,
              "top_p": ns.top_p, "top_k": ns.top_k, "min_p": ns.min_p,
              "repetition_penalty": ns.repetition_penalty}
    params = {k: v for k, v in params.items() if v is not None}
    if ns.sampling_seed is not None:
        params["seed"] = ns.sampling_seed

    def respond(history: list[dict]) -> str | None:
        try:
            return stream_reply(base, api_key, {**params, "messages": history})
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return None
    return run_chat_loop(ns.system, f"kvflow chat with {model} at {base}", respond)


QUIT_COMMANDS = ("/quit", "/exit", "/bye")


def line_reader() -> Callable[[], str]:
    """A function reading one user turn (EOFError at the end). On a terminal,
    prompt-toolkit gives line editing and history (arrow keys edit the line instead of
    reaching the model as escape codes); piped input is read plainly."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        try:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory
        except ImportError:
            pass
        else:
            session = PromptSession(history=InMemoryHistory())
            return lambda: session.prompt("> ")
    return lambda: input("> ")


def run_chat_loop(system: str | None, banner: str,
                  respond: Callable[[list[dict]], str | None],
                  read: Callable[[], str] | None = None) -> int:
    """Read user turns until /quit, /exit or Ctrl-D; ``respond`` streams a reply to the
    conversation so far and returns its text (None: it failed, the turn is dropped).
    An empty line asks nothing; Ctrl-C at the prompt clears the line, and during a reply
    stops only that reply (the turn is dropped, as if it had not been asked)."""
    read = read or line_reader()
    history: list[dict] = []
    if system:
        history.append({"role": "system", "content": system})
    print(f"{banner} - /quit or Ctrl-D to quit, Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            user = read()
        except EOFError:
            break
        except KeyboardInterrupt:
            continue
        if user.strip() in QUIT_COMMANDS:
            break
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        try:
            reply = respond(history)
        except KeyboardInterrupt:
            print("\n[reply stopped]", file=sys.stderr)
            reply = None
        if reply is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
    return 0
