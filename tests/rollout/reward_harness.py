"""A harness that scores itself: it asks the model once through the `openai` SDK, prints the reply,
and posts its own reward with the credential the launcher handed it.

The reward is `posted_reward(reply)`, so a test can recompute it from the call the sidecar
recorded. `--post-when-suffix S` posts only for rollout ids ending in S (the other runs are left
to the evaluator); `--probe-sibling` also tries the credential on a sibling rollout of the same
group and exits 3 unless the sidecar refuses it.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
from openai import OpenAI


def posted_reward(reply: str) -> float:
    return 0.5 + len(reply) / 1000


def post(url: str, token: str, reward: float) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.post(url, json={"reward": reward}, headers=headers, timeout=60.0)


def sibling(url: str, rollout_id: str) -> str:
    """The reward URL of the other run of this group (rollout ids end in -r0, -r1, ...)."""
    stem, _, index = rollout_id.rpartition("-r")
    other = f"{stem}-r{1 - int(index) if index in ('0', '1') else 0}"
    return url.replace(f"/rollouts/{rollout_id}/", f"/rollouts/{other}/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--post-when-suffix", default="", help="post only for ids ending so")
    parser.add_argument("--probe-sibling", action="store_true")
    args = parser.parse_args()
    client = OpenAI(max_retries=0, timeout=600.0)
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": sys.stdin.read()}],
        max_tokens=args.max_tokens,
        temperature=1.0,
    )
    text = reply.choices[0].message.content or ""
    sys.stdout.buffer.write(text.encode("utf-8", errors="replace") + b"\n")
    rollout_id = os.environ["HARNESSRL_ROLLOUT_ID"]
    url, token = os.environ["HARNESSRL_REWARD_URL"], os.environ["HARNESSRL_REWARD_TOKEN"]
    if "HARNESSRL_CONTROL_TOKEN" in os.environ:
        print("the control token reached the harness", file=sys.stderr)
        return 4
    if args.probe_sibling:
        other = post(sibling(url, rollout_id), token, 1.0)
        if other.status_code != 401:
            print(f"sibling reward answered {other.status_code}: {other.text}", file=sys.stderr)
            return 3
    if rollout_id.endswith(args.post_when_suffix):
        answer = post(url, token, posted_reward(text))
        if answer.status_code != 200:
            print(f"reward post answered {answer.status_code}: {answer.text}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
