"""Caption every image of a folder into a JSONL file, with a vision-language model.

    python examples/caption_folder.py photos/ --model Qwen/Qwen3-VL-2B-Instruct -o captions.jsonl

Builds an OpenAI batch file (one chat line per image, the image as a local path) beside the output and
runs it through `overnight run-batch`, which shows progress (lines, tokens/s) and, run again after a crash
or Ctrl-C, resumes: lines already answered are skipped. Then writes captions.jsonl, one
{"image": relative path, "caption": text} per image (or {"image", "error"} for an image that failed: a
broken file fails its own line, never the run). Extra arguments go to run-batch
(e.g. --max-num-seqs 64, --limit-mm-per-prompt 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def list_images(folder: str) -> list[str]:
    """Image files under `folder`, as paths relative to it, in a stable order."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            if name.lower().endswith(IMAGE_EXTENSIONS):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(found)


def write_requests(folder: str, images: list[str], path: str, prompt: str, max_tokens: int) -> None:
    with open(path, "w") as f:
        for rel in images:
            body = {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": os.path.join(folder, rel)}},
                            {"type": "text", "text": prompt},
                        ],
                    }
                ],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            line = {"custom_id": rel, "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(line) + "\n")


def write_captions(results: str, captions: str) -> int:
    """captions.jsonl from run-batch's results, in the folder's order; returns the failed count."""
    failed = 0
    records = {}
    with open(results) as f:
        for raw in f:
            if raw.strip():
                r = json.loads(raw)
                records[r["custom_id"]] = r
    with open(captions, "w") as f:
        for cid in sorted(records):
            r = records[cid]
            if r.get("error"):
                failed += 1
                f.write(json.dumps({"image": cid, "error": r["error"]["message"]}) + "\n")
            else:
                text = r["response"]["body"]["choices"][0]["message"]["content"]
                f.write(json.dumps({"image": cid, "caption": text}) + "\n")
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="folder of images (searched recursively)")
    p.add_argument("--model", required=True, help="a vision-language model (Qwen2.5-VL, Qwen3-VL)")
    p.add_argument("-o", "--output", default="captions.jsonl", help="captions, one JSON object per image")
    p.add_argument("--prompt", default="Describe this image in one sentence.")
    p.add_argument("--max-tokens", type=int, default=96)
    args, extra = p.parse_known_args(argv)
    from overnight.cli import main as overnight_main

    folder = os.path.abspath(args.folder)
    images = list_images(folder)
    if not images:
        print(f"no images in {folder}", file=sys.stderr)
        return 1
    requests = args.output + ".requests.jsonl"
    results = args.output + ".results.jsonl"
    write_requests(folder, images, requests, args.prompt, args.max_tokens)
    resume = ["--resume"] if os.path.exists(results) else []
    code = overnight_main(
        [
            "run-batch",
            "-i",
            requests,
            "-o",
            results,
            "--model",
            args.model,
            "--allowed-local-media-path",
            folder,
        ]
        + resume
        + extra
    )
    if code != 0:
        return code
    failed = write_captions(results, args.output)
    print(
        f"{len(images) - failed} captions in {args.output}" + (f", {failed} images failed" if failed else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
