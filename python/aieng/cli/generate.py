"""`aieng generate` (one prompt, streamed or not) and `aieng chat` (an interactive session)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from aieng.cli.common import load_llm, non_negative_float, positive_int, probability
from aieng.config.engine_args import EngineArgs

# One prompt at a time: a larger max_num_seqs would only reserve KV cache memory for nothing.
ENGINE_DEFAULTS = {"max_num_seqs": 1}


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--max-tokens", type=positive_int, default=max_tokens, metavar="N",
        help=f"tokens to generate at most (default: {max_tokens})",
    )  # fmt: skip
    parser.add_argument(
        "--temperature", type=non_negative_float, metavar="T",
        help="0 is greedy (default: the model's generation_config.json, else 1.0)",
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=probability, metavar="P", help="nucleus sampling mass (default: model's)"
    )
    parser.add_argument("--top-k", type=int, metavar="K", help="keep the K likeliest tokens")
    parser.add_argument(
        "--stop", action="append", metavar="TEXT", help="stop at this string (repeatable)"
    )


def add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a continuation of PROMPT and print it.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    add_sampling_options(p, max_tokens=128)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument(
        "--no-echo", action="store_true", help="print only the continuation, not the prompt"
    )
    p.add_argument("--stats", action="store_true", help="print token count and speed to stderr")
    EngineArgs.add_cli_args(p, ENGINE_DEFAULTS)
    p.set_defaults(run=run_generate)


def add_chat(commands) -> None:
    p = commands.add_parser(
        "chat",
        help="an interactive chat using the model's chat template",
        description="Chat with the model: type a message and press Enter. Commands: /reset "
        "starts over, /exit (or end of input) leaves.",
    )
    add_sampling_options(p, max_tokens=256)
    p.add_argument("--system", metavar="TEXT", help="a system message to start with")
    EngineArgs.add_cli_args(p, ENGINE_DEFAULTS)
    p.set_defaults(run=run_chat)


def sampling_params(llm, args: argparse.Namespace):
    """The model's defaults, overridden by the options given (--seed is the engine's: it
    seeds every request that brings no seed of its own, as here)."""
    overrides: dict[str, Any] = {"max_tokens": args.max_tokens}
    for name in ("temperature", "top_p", "top_k", "stop"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    return dataclasses.replace(llm.default_sampling_params, **overrides)


def run_generate(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    params = sampling_params(llm, args)
    out = sys.stdout
    if not args.no_echo:
        out.write(args.prompt)
        out.flush()
    start = time.perf_counter()
    tokens = 0
    if args.stream:
        for chunk in llm.stream(args.prompt, params):
            completion = chunk.outputs[0]
            tokens += len(completion.token_ids)
            out.write(completion.text)
            out.flush()
    else:
        [result] = llm.generate(args.prompt, params, use_tqdm=False)
        tokens = len(result.outputs[0].token_ids)
        out.write(result.outputs[0].text)
    out.write("\n")
    out.flush()
    if args.stats:
        seconds = time.perf_counter() - start
        speed = f"{tokens / seconds:.1f} tok/s"
        print(f"[{tokens} tokens in {seconds:.2f} s, {speed}]", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    params = sampling_params(llm, args)
    tokenizer = llm.get_tokenizer()
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    if interactive:
        print("aieng chat: /reset starts over, /exit leaves.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply = []
        for chunk in llm.stream(ids, params):
            piece = chunk.outputs[0].text
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply).strip()})
    return 0
