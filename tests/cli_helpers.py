"""Running the CLI in-process in tests, and what a one-line error looks like."""

from __future__ import annotations

import pytest

from llmeasyquant.cli import main


def run(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what earlier steps printed
    code = main(["--quiet", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit code 2 and the whole message on the last line of stderr; no traceback.

    (Lines before it may be transformers' "Loading weights" progress bar, which --quiet does not silence: see
    test_quiet_silences_progress_bars.)
    """
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert lines[-1].startswith("llmeasyquant: error: "), err
    assert sum("error" in line.lower() for line in lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[-1], lines[-1]
