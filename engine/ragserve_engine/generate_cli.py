"""`ragserve generate`: offline generation for a chat prompt, no server."""

from __future__ import annotations

import argparse
import sys
import time

from ragserve.flags import add_flag

DEFAULT_PROMPT = "In two sentences: what is a KV cache, and why does reusing it speed up RAG?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragserve.engine_args import add_engine_arguments

    add_engine_arguments(parser)
    g = parser.add_argument_group("generation")
    add_flag(g, "--prompt", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    add_flag(g, "--raw", action="store_true", help="send --prompt as is, without the chat template")
    add_flag(g, "--max-tokens", type=int, default=64, help="tokens to generate")
    add_flag(g, "--temperature", type=float, default=0.0, help="0 = greedy")


def run(args: argparse.Namespace) -> int:
    from ragserve.engine_args import EngineConfig
    from ragserve_engine.llm import LLM
    from ragserve_engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**vars(EngineConfig.from_args(args)))
    load_s = time.perf_counter() - t0
    prompt = args.prompt if args.raw else llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    t1 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))[0]
    gen_s = time.perf_counter() - t1
    completion = out.outputs[0]
    print(f"> {args.prompt}\n{completion.text.strip()}")
    print(
        f"[{llm.engine.source.name}: loaded in {load_s:.1f}s; {len(out.prompt_token_ids)} prompt + "
        f"{len(completion.token_ids)} generated tokens in {gen_s:.2f}s; finish={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0
