"""`overnight run-batch`: OpenAI batch files through the offline engine, crash-safe and resumable.

reader    input lines -> BatchLine (a parsed request, or that line's error)
runner    BatchRunner: lines -> look-ahead window -> engine requests -> results, bounded in flight
ordering  OutputOrder: write in input order or as lines finish
spill     finished lines waiting for an earlier one, on disk beside the output; --resume takes them back
timeline  what the schedule did: time split, tail, prefix-cache hit rate (in the summary)
output    the output file: whole-line flushed writes, --resume repair and scan, Sink
records   the output line format (success / failure records)
progress  the progress bar; summary: the end-of-run summary (stderr, --summary-json)
validate  --validate-only
show      `python -m overnight.batch.show results.jsonl`: the first results as text
cli       the command line
"""
