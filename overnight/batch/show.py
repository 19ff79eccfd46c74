"""`python -m overnight.batch.show results.jsonl [-n 5]`: the first results of a run-batch output, as text.

Each line shows the custom_id and, for a success, every choice's text (one line each, shortened); for a
failure, the error code and message.
"""

from __future__ import annotations

import argparse
import json
import sys

_WIDTH = 100


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _WIDTH else flat[: _WIDTH - 3] + "..."


def describe(record: dict) -> list[str]:
    head = f"[{record.get('custom_id')}]"
    error = record.get("error")
    if error:
        return [f"{head} error {error.get('code')}: {error.get('message')}"]
    body = record["response"]["body"]
    out = []
    for choice in body["choices"]:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        label = f"{head} #{choice['index']}" if len(body["choices"]) > 1 else head
        out.append(f"{label} {_short(text or '')}  ({choice['finish_reason']})")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overnight.batch.show", description=__doc__)
    p.add_argument("path")
    p.add_argument("-n", type=int, default=5, help="how many lines (default 5)")
    args = p.parse_args(argv)
    with open(args.path) as f:
        for i, raw in enumerate(f):
            if i >= args.n:
                break
            for line in describe(json.loads(raw)):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
