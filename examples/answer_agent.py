"""A small question-answering agent, written only against the `openai` SDK.

It reads a question on stdin (or --question), asks the model, and looks for a number in the reply.
If there is none it tries again (a fresh attempt, or with --feedback the same conversation plus a
nudge), up to --max-attempts model calls. It prints its final answer on stdout and exits 0; it exits
non-zero only when the model endpoint itself fails. The endpoint comes from OPENAI_BASE_URL and
OPENAI_API_KEY, as for any OpenAI client.
"""

from __future__ import annotations

import argparse
import re
import sys

from openai import OpenAI

NUMBER = re.compile(r"-?\d+")
NUDGE = "Please reply with just the number."


def ask(client: OpenAI, args: argparse.Namespace, messages: list[dict[str, str]]) -> str:
    reply = client.chat.completions.create(
        model=args.model,
        messages=messages,  # type: ignore[arg-type]
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    return reply.choices[0].message.content or ""


def solve(client: OpenAI, args: argparse.Namespace, question: str) -> str:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": question})
    text = ""
    for attempt in range(args.max_attempts):
        text = ask(client, args, messages)
        numbers = NUMBER.findall(text)
        if numbers:
            return numbers[-1]
        if args.feedback:
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": NUDGE}]
        print(f"attempt {attempt + 1}: no number in {text!r}", file=sys.stderr)
    return text.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--question", help="the question; read from stdin when omitted")
    parser.add_argument("--model", default="default", help="model name sent to the endpoint")
    parser.add_argument("--system", default="", help="optional system message")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument(
        "--feedback", action="store_true", help="retry in the same conversation with a nudge"
    )
    args = parser.parse_args()
    question = args.question if args.question is not None else sys.stdin.read().strip()
    if not question:
        parser.error("no question: pass --question or write it on stdin")
    client = OpenAI(max_retries=0, timeout=600.0)
    print(solve(client, args, question))
    return 0


if __name__ == "__main__":
    sys.exit(main())
