import threading

import pytest

from cellbatch.threads import in_short_lived_thread


def test_returns_the_value_computed_on_another_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert in_short_lived_thread(work) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_reraises_the_functions_exception_in_the_caller() -> None:
    def fail() -> None:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        in_short_lived_thread(fail)
