"""The output file: written a whole line at a time and flushed, so a crash leaves at most one torn line;
resumed by dropping that line and skipping the custom_ids already answered.

A line is written with one write() and then flushed: a process killed mid-write leaves the line without
its final newline, which is exactly what `repair_and_scan` recognises and drops.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from overnight.batch.records import encode, is_failure, reported_line

log = logging.getLogger("overnight.batch")

_CHUNK = 1 << 16


class UsageError(Exception):
    """A problem with the command line or the files it names; nothing was run."""


@dataclass
class Answered:
    """What an existing output already holds."""

    custom_ids: set[str] = field(default_factory=set)
    # Failures that name no custom_id of their own (unreadable id, or a duplicate id), by input line.
    lines: set[int] = field(default_factory=set)
    num_records: int = 0
    num_failures: int = 0
    torn_bytes: int = 0  # size of the torn last line that was dropped

    def merge(self, other: Answered) -> None:
        self.custom_ids |= other.custom_ids
        self.lines |= other.lines
        self.num_records += other.num_records
        self.num_failures += other.num_failures
        self.torn_bytes += other.torn_bytes


def repair_and_scan(path: str) -> Answered:
    """Truncate a torn last line (no final newline) off `path`, then read what it answers."""
    answered = Answered()
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = end_of_last_full_line(f, size)
        if end < size:
            f.truncate(end)
            answered.torn_bytes = size - end
            log.warning("dropped a torn last line (%d bytes) from %s", size - end, path)
        f.seek(0)
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                custom_id = record.get("custom_id")
            except (ValueError, AttributeError):
                log.warning("%s line %d is not a result record; ignored", path, line_no)
                continue
            answered.num_records += 1
            answered.num_failures += is_failure(record)
            is_duplicate = (record.get("error") or {}).get("code") == "duplicate_custom_id"
            if isinstance(custom_id, str) and not is_duplicate:
                answered.custom_ids.add(custom_id)
            elif (n := reported_line(record)) is not None:
                answered.lines.add(n)
    return answered


def end_of_last_full_line(f: BinaryIO, size: int) -> int:
    """Offset just past the last newline (0 if none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - _CHUNK)
        f.seek(start)
        chunk = f.read(pos - start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


def check_output(path: str, *, resume: bool, overwrite: bool, what: str = "output") -> None:
    """Refuse, before anything runs, to clobber a non-empty file or to resume onto stdout."""
    if path == "-":
        if resume:
            raise UsageError(f"--resume needs an {what} file, not stdout")
        return
    if os.path.isdir(path):
        raise UsageError(f"{what} {path} is a directory")
    if os.path.exists(path) and os.path.getsize(path) > 0 and not resume and not overwrite:
        raise UsageError(
            f"{what} file {path} exists and is not empty: pass --resume to continue it, "
            "or --overwrite to replace it"
        )


def lock_output(path: str, what: str = "output") -> BinaryIO:
    """Open `path` for appending (created, never truncated here) and take an exclusive lock on it for
    as long as this process holds the file, so a second run-batch on the same file stops at once
    instead of interleaving its lines with the first's. Taken before the model loads."""
    if path == "-":
        return sys.stdout.buffer
    if os.path.isdir(path):
        raise UsageError(f"{what} {path} is a directory")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path, "ab")
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no lock
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UsageError(
            f"{what} file {path} is being written by another run-batch (it holds a lock on the file): "
            "wait for that run to end, or write to another file"
        ) from None
    return f


def open_output(
    path: str, *, resume: bool, overwrite: bool, what: str = "output", locked: BinaryIO | None = None
) -> tuple[BinaryIO, Answered]:
    """The file to append results to, and what it already answers (empty unless resuming). `locked`:
    the handle lock_output returned for this path (else the lock is taken here)."""
    check_output(path, resume=resume, overwrite=overwrite, what=what)
    f = locked if locked is not None else lock_output(path, what)
    if path == "-":
        return f, Answered()
    if resume and os.path.getsize(path) > 0:
        return f, repair_and_scan(path)  # appends land after the repaired end (append mode)
    f.truncate(0)
    return f, Answered()


class Sink:
    """Writes records as they come: successes to the output; failures there too, or to the errors
    file when one is given (as the OpenAI Batch API keeps an error file apart)."""

    def __init__(self, out: BinaryIO, errors: BinaryIO | None = None) -> None:
        self.out = out
        self.errors = errors

    def write(self, record: dict[str, Any]) -> None:
        f = self.errors if self.errors is not None and is_failure(record) else self.out
        f.write(encode(record))
        f.flush()

    def close(self) -> None:
        for f in (self.out, self.errors):
            if f is not None and f is not sys.stdout.buffer:
                f.close()
