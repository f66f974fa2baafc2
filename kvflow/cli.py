"""The ``kvflow`` command: serve, generate, chat, bench, plan, quantize."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from kvflow.engine.args import EngineArgs
from kvflow.errors import KvflowError

EXAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
]


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    # Unset flags stay None so the engine fills them, as for the server and LLM: the
    # model's recommended sampling, the max_tokens default and the repetition guard.
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate "
                   "(default: the engine's --max-tokens-default, else up to the context)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's recommendation, else 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _sampling_params(ns: argparse.Namespace, **extra):
    from kvflow.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                          top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                          repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed,
                          **extra)


def _torchrun_worker(engine_args: EngineArgs) -> int | None:
    """Under torchrun, a rank other than 0 runs rank 0's steps instead of the command;
    returns its exit code (None: this process runs the command)."""
    from kvflow.distributed.torchrun import torchrun_rank
    from kvflow.worker.rank_proc import run_torchrun_rank

    tr = torchrun_rank()
    if tr is None or tr.rank == 0:
        return None
    return run_torchrun_rank(engine_args.create_engine_config(), tr)


def cmd_generate(ns: argparse.Namespace) -> int:
    from kvflow.llm import LLM

    code = _torchrun_worker(EngineArgs.from_cli_args(ns))
    if code is not None:
        return code
    prompts = ns.prompt or EXAMPLE_PROMPTS
    params = _sampling_params(ns)
    # Shut down on the way out: other ranks (torchrun's among them) exit 0 only when
    # rank 0 stops them.
    with LLM(**vars(EngineArgs.from_cli_args(ns))) as llm:
        start = time.perf_counter()
        if ns.no_chat_template or llm.get_tokenizer() is None \
                or llm.get_tokenizer().chat_template is None:
            outputs = llm.generate(prompts, params)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"\n{len(outputs)} prompts, {n_in} prompt tokens, {n_out} generated tokens in "
          f"{elapsed:.2f} s: {n_out / elapsed:.1f} output tokens/s, "
          f"{(n_in + n_out) / elapsed:.1f} total tokens/s")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from kvflow.entrypoints.openai.server import run_server
    from kvflow.entrypoints.openai.server_args import ServerArgs

    engine_args = EngineArgs.from_cli_args(ns)
    code = _torchrun_worker(engine_args)
    if code is not None:
        return code
    if engine_args.node_rank > 0:  # a node other than node 0 runs ranks, not the server
        from kvflow.distributed.launch import run_node

        return run_node(engine_args.create_engine_config())
    return run_server(engine_args, ServerArgs.from_cli_args(ns))


def cmd_chat(ns: argparse.Namespace) -> int:
    if ns.url:
        from kvflow.entrypoints.chat_client import chat_with_server

        return chat_with_server(ns)
    from kvflow.engine.llm_engine import LLMEngine
    from kvflow.sampling_params import OutputKind

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    tok = engine.tokenizer
    if tok is None or tok.chat_template is None:
        print("error: this model has no chat template: pass one with --chat-template "
              "(a file or inline Jinja)", file=sys.stderr)
        return 2
    from kvflow.entrypoints.chat_client import run_chat_loop

    turns = iter(range(1 << 62))

    def respond(history: list[dict]) -> str | None:
        prompt = tok.apply_chat_template(history, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        rid = f"chat-{next(turns)}"
        try:
            engine.add_request(rid, {"prompt_token_ids": ids},
                               _sampling_params(ns, output_kind=OutputKind.DELTA))
        except KvflowError as e:
            print(f"error: {e}", file=sys.stderr)
            return None
        reply = []
        # Ctrl-C stops this reply, not the chat: it is noted between steps (an interrupt
        # inside a step would leave the scheduler half-way through it).
        stop: list[int] = []
        previous = signal.signal(signal.SIGINT, lambda *_: stop.append(1))
        try:
            while engine.has_unfinished_requests() and not stop:
                for out in engine.step():
                    for c in out.outputs:
                        reply.append(c.text)
                        print(c.text, end="", flush=True)
            if stop:
                engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    engine.step()
        finally:
            signal.signal(signal.SIGINT, previous)
        if stop:
            raise KeyboardInterrupt
        print()
        return "".join(reply)
    return run_chat_loop(ns.system, "kvflow chat", respond)


class NoAbbrevParser(argparse.ArgumentParser):
    """A parser that takes flags only as spelled: argparse's prefix matching would turn
    ``--max-tokens 100`` into ``--max-tokens-default 100`` without a word. Subcommand
    parsers are made of the parent's class, so the whole tree inherits this."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = NoAbbrevParser(prog="kvflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the "
                           "embedded model on http://127.0.0.1:8000)")
    EngineArgs.add_cli_args(serve)
    from kvflow.entrypoints.openai.server_args import ServerArgs

    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate answers to prompts and report speed")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: "
                     "a few example questions")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="send prompts as raw text instead of chat messages")
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming as tokens arrive")
    EngineArgs.add_cli_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--url", default=None, help="chat with a running server (e.g. "
                      "http://127.0.0.1:8000) instead of loading the model here")
    chat.add_argument("--api-key", default=None, help="the server's API key (with --url; "
                      "default: $KVFLOW_API_KEY)")
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from kvflow.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from kvflow.plan.cli import add_plan_parser

    add_plan_parser(sub)
    from kvflow.train.cli import add_train_eagle_parser, add_train_medusa_parser

    add_train_medusa_parser(sub)
    add_train_eagle_parser(sub)
    from kvflow.quantize.cli import add_quantize_parser

    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if argv is not None:  # called in-process: results record these arguments
        from kvflow.bench import machine

        machine.cli_argv = list(argv)
    try:
        return ns.func(ns)
    except KvflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
