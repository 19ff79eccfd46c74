"""The spill: finished lines that cannot be written yet (an earlier line still runs, --order input) wait
on disk beside the output, in `<output>.spill`, so memory holds only where each one is and new lines
keep starting however long the line at the head runs.

What is durable when (a kill -9 can land anywhere):

1. A record is durable once it is in the output (or the errors file) or in the spill: each is one
   write() of a whole line, then a flush. A torn last line in either is dropped on --resume.
2. A record goes to the output only after every earlier line's record, so the output always holds
   the answered lines in input order with none missing before its last line.
3. The spill is append-only while a run lasts. A spilled record that the output also answers is
   stale (it was written on, then the process died): --resume reads the output first and ignores it.
4. The spill is deleted only when the run has written every record (status completed).

On --resume the spill's live successes are indexed by custom_id; when the input reaches such a line it
is placed from the spill instead of computed (without being appended again), and the output goes on in
input order. Spilled failures are not taken back: reading the line again gives the same error at no cost.
The output "-" (stdout) gets an anonymous spill, which cannot be resumed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any, BinaryIO

from overnight.batch.output import UsageError, end_of_last_full_line
from overnight.batch.records import encode, is_failure

log = logging.getLogger("overnight.batch")

SpillRef = tuple[int, int]  # (offset, length) of one record in the spill


def spill_path(output_path: str) -> str:
    return output_path + ".spill"


def check_spill(output_path: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start afresh over finished lines an interrupted run left in the spill."""
    if output_path == "-" or resume or overwrite:
        return
    path = spill_path(output_path)
    if os.path.exists(path) and os.path.getsize(path) > 0:
        raise UsageError(
            f"{path} holds finished lines of an interrupted run: pass --resume to continue it, "
            "or --overwrite to start again"
        )


class Spill:
    """Append records, read them back by reference. The file is created on the first append."""

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: an anonymous temporary file
        self.recovered: dict[str, SpillRef] = {}  # an earlier run's live successes, by custom_id
        self.num_appended = 0
        self._writer: BinaryIO | None = None
        self._reader: BinaryIO | None = None
        self._size = 0

    @property
    def durable(self) -> bool:
        return self.path is not None

    @classmethod
    def beside(cls, output_path: str, *, resume: bool, answered_ids: set[str]) -> Spill:
        """The spill of `output_path`: with resume, what an earlier run left there is recovered
        (after dropping a torn last line); otherwise an old spill is removed."""
        if output_path == "-":
            return cls(None)
        path = spill_path(output_path)
        spill = cls(path)
        if os.path.exists(path):
            if resume:
                spill._recover(answered_ids)
            else:
                os.remove(path)
        return spill

    def _recover(self, answered_ids: set[str]) -> None:
        assert self.path is not None
        with open(self.path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            end = end_of_last_full_line(f, size)
            if end < size:
                f.truncate(end)
                log.warning("dropped a torn last line (%d bytes) from %s", size - end, self.path)
            f.seek(0)
            offset = 0
            for raw in f:
                ref = (offset, len(raw))
                offset += len(raw)
                try:
                    record = json.loads(raw)
                    cid = record.get("custom_id")
                except (ValueError, AttributeError):
                    continue
                if isinstance(cid, str) and not is_failure(record) and cid not in answered_ids:
                    self.recovered.setdefault(cid, ref)
        self._size = end

    def append(self, record: dict[str, Any]) -> SpillRef:
        if self._writer is None:
            self._open()
        assert self._writer is not None
        data = encode(record)
        self._writer.write(data)
        self._writer.flush()
        ref = (self._size, len(data))
        self._size += len(data)
        self.num_appended += 1
        return ref

    def read(self, ref: SpillRef) -> dict[str, Any]:
        if self._reader is None:
            self._open()
        assert self._reader is not None
        offset, length = ref
        return json.loads(os.pread(self._reader.fileno(), length, offset))

    def _open(self) -> None:
        if self.path is None:
            self._writer = tempfile.TemporaryFile()
            self._reader = self._writer
        else:
            self._writer = open(self.path, "ab")
            self._reader = open(self.path, "rb")

    def close(self, *, remove: bool) -> None:
        """Close the files; `remove` deletes the spill (it holds nothing a later run needs)."""
        for f in {id(f): f for f in (self._writer, self._reader) if f is not None}.values():
            f.close()
        self._writer = self._reader = None
        if remove and self.path is not None and os.path.exists(self.path):
            os.remove(self.path)
