"""``ContainerProcess``, the tests' ``mdb run``: what it shows when a test fails while it runs."""

from __future__ import annotations

import pytest

from tests.conftest import Backend


def test_a_test_failing_while_the_container_runs_shows_its_output_and_every_threads_stack(
        embedded: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    """A test that timed out waiting for the container sees where each of its threads was."""
    queue = embedded.q("ORDERS")
    settings = embedded.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    container = embedded.container(settings)
    with pytest.raises(AssertionError, match="timed out"), container:
        raise AssertionError("timed out after 60s waiting for something")
    assert not container.alive(), "killed once its stacks were written"
    shown = capsys.readouterr().out
    assert "--- output of mdb run" in shown
    assert "most recent call first" in shown, "the thread dump is in what the failure shows"
