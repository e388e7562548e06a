"""`cellbatch serve --replicas` options: wrong combinations are refused before any Ray
or model starts (exit 2, one line naming the fix)."""

from __future__ import annotations

import pytest

from cellbatch.cli import main


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--threads-per-replica", "2"], "--threads-per-replica needs --replicas N"),
        (["--ray-address", "auto"], "--ray-address needs --replicas N"),
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--replicas", "2", "--threads", "2"], "with --replicas use --threads-per-replica"),
        (["--replicas", "2", "--threads-per-replica", "0"], "must be >= 1, got 0"),
        (["--replicas", "2", "--numa", "0"], "Ray places the replicas"),
        (["--replicas", "2", "--max-sessions", "0"], "--max-sessions must be >= 1, got 0"),
    ],
)
def test_wrong_replica_options_are_refused_up_front(options, message, capsys) -> None:
    assert main(["serve", *options]) == 2
    assert message in capsys.readouterr().err
