"""The ``kvzoo`` command.

    kvzoo list                                   the registry: names, summaries, papers
    kvzoo run --policy streaming_llm --ratio 4   one policy on one prompt; prints answer and stats
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _parse_value(text: str) -> Any:
    """``--param k=v`` values: JSON when it parses (numbers, true/false, null), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _policy_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in args.param or []:
        if "=" not in item:
            raise SystemExit(f"--param expects key=value (e.g. --param sinks=4), got {item!r}")
        key, value = item.split("=", 1)
        params[key] = _parse_value(value)
    if args.ratio is not None:
        params["ratio"] = args.ratio
    if args.budget is not None:
        params["budget"] = args.budget
    return params


def cmd_list(args: argparse.Namespace) -> int:
    from kvzoo import registry

    names = registry.available()
    width = max(len(n) for n in names)
    for name, summary in names.items():
        info = registry.info(name)
        paper = f"  [{info['paper']}]" if info.get("paper") else ""
        print(f"{name:<{width}}  {summary}{paper}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from kvzoo import pipeline, registry
    from kvzoo.models import load_model

    try:
        policy = registry.get(args.policy, **_policy_params(args))
    except (KeyError, TypeError, ValueError) as err:
        print(f"kvzoo run: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    if args.context_file and not args.question:
        print("kvzoo run: --question is required with --context-file", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model)
    if args.context_file:
        with open(args.context_file, encoding="utf-8") as fh:
            context = fh.read()
        question = args.question
    else:
        from kvzoo.demo import QUESTION, build_needle_context

        if tokenizer is None:
            print(f"kvzoo run: model {args.model!r} has no tokenizer; the needle task needs one", file=sys.stderr)
            return 2
        context = build_needle_context(tokenizer, context_tokens=args.context_tokens, depth=args.depth).text
        question = args.question or QUESTION
    result = pipeline.generate(
        model,
        tokenizer,
        context,
        question,
        policy,
        max_new_tokens=args.max_new_tokens,
        question_position=args.question_position,
        chunk_size=args.chunk_size,
    )
    print(f"policy   : {policy}")
    print(f"context  : {result.context_tokens} tokens; question {'after' if args.question_position == 'after' else 'before'} compression")
    print(f"question : {question}")
    print(f"answer   : {result.answer!r}")
    print("timings  : " + ", ".join(f"{k} {v:.2f}s" for k, v in result.timings.items()))
    print(result.stats)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvzoo", description="KV-cache policies on one tiered-cache runtime")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,run}")
    p_list = sub.add_parser("list", help="the registered policies")
    p_list.set_defaults(func=cmd_list)
    p_run = sub.add_parser("run", help="one policy on one prompt (default: a needle in a generated context)")
    p_run.add_argument("--policy", default="full", help="registered name (see `kvzoo list`)")
    p_run.add_argument("--ratio", type=float, help="keep 1/ratio of the rows")
    p_run.add_argument("--budget", type=int, help="keep this many rows per layer and KV group")
    p_run.add_argument("--param", action="append", metavar="KEY=VALUE", help="any other policy parameter")
    p_run.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-llama, or a local directory")
    p_run.add_argument("--context-file", help="a text file to use as the context (needs --question)")
    p_run.add_argument("--question", help="the question asked about the context")
    p_run.add_argument("--context-tokens", type=int, default=2000, help="needle context length in tokens")
    p_run.add_argument("--depth", type=float, default=0.35, help="needle depth in [0, 1]")
    p_run.add_argument("--question-position", choices=["after", "before"], default="after")
    p_run.add_argument("--max-new-tokens", type=int, default=24)
    p_run.add_argument("--chunk-size", type=int, default=None, help="prefill in chunks of this many tokens")
    p_run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
