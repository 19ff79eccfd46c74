"""run-batch's output file (batch/output.py): one run at a time writes it."""

from __future__ import annotations

import pytest


def test_an_output_file_is_locked_against_a_second_run(tmp_path):
    from overnight.batch.output import UsageError, lock_output, open_output

    path = str(tmp_path / "out.jsonl")
    first = lock_output(path)
    with pytest.raises(UsageError, match="being written by another run-batch"):
        lock_output(path)
    f, answered = open_output(path, resume=False, overwrite=False, locked=first)
    f.write(b"x\n")
    f.close()  # the lock goes with the file
    lock_output(path).close()
