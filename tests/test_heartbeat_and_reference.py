"""The heartbeat names what a silent run waits on; the recipe reference matches the code."""

from __future__ import annotations

import time
from pathlib import Path

from octfw.engine.heartbeat import Heartbeat
from octfw.recipe.reference import render_reference

REPO = Path(__file__).resolve().parents[1]


def test_heartbeat_warns_once_per_silence_and_names_the_phase():
    messages: list[str] = []
    with Heartbeat(0.2, report=messages.append) as heartbeat:
        heartbeat.waiting_on("the data loader")
        time.sleep(0.7)
        heartbeat.beat(3)
        heartbeat.waiting_on("the device (reading metrics)")
        time.sleep(0.7)
    assert len(messages) == 2
    assert "since start; waiting on the data loader" in messages[0]
    assert "since update step 3; waiting on the device (reading metrics)" in messages[1]


def test_a_silence_that_moves_on_to_another_phase_is_named_again():
    """A slow first device step, then a stalled loader, in one silence: both are named (the first
    alone would send the user to the device while the data loader is what hangs)."""
    messages: list[str] = []
    with Heartbeat(0.2, report=messages.append) as heartbeat:
        heartbeat.beat(1)
        heartbeat.waiting_on("the device (reading metrics)")
        time.sleep(0.5)
        heartbeat.waiting_on("the data loader")
        time.sleep(0.5)
    assert [m.rsplit("waiting on ", 1)[1] for m in messages] == ["the device (reading metrics)", "the data loader"]
    assert all("since update step 1" in m for m in messages)


def test_heartbeat_is_quiet_while_steps_complete():
    messages: list[str] = []
    with Heartbeat(0.5, report=messages.append) as heartbeat:
        for step in range(10):
            time.sleep(0.05)
            heartbeat.beat(step)
    assert messages == []


def test_recipe_reference_is_generated_from_the_code(registry):
    committed = (REPO / "docs" / "recipe-reference.md").read_text()
    assert committed == render_reference(registry), \
        "docs/recipe-reference.md is stale: python -m octfw.recipe.reference > docs/recipe-reference.md"
