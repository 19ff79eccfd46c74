"""`overnight run-batch`: OpenAI batch files through the offline engine, crash-safe and resumable.

reader    input lines -> BatchLine (a parsed request, or that line's error)
runner    BatchRunner: lines -> engine requests -> results, with bounded requests in flight
ordering  OutputOrder: write in input order (bounded reorder window) or as lines finish
output    the output file: whole-line flushed writes, --resume repair and scan, Sink
records   the output line format (success / failure records)
progress  the progress bar; summary: the end-of-run summary (stderr, --summary-json)
validate  --validate-only
show      `python -m overnight.batch.show results.jsonl`: the first results as text
cli       the command line
"""
