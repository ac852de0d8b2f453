"""Warnings for a checkpoint interval in step with logging or gradient accumulation."""

from __future__ import annotations

from octfw.engine.cadence import cadence_warnings, suggest_interval
from octfw.recipe.config import EngineConfig


def test_interval_that_is_a_multiple_of_the_log_interval_is_flagged_with_a_suggestion():
    [warning] = cadence_warnings(EngineConfig(checkpoint_every_steps=1000, log_every_steps=10))
    assert "checkpoint_every_steps = 1000 is a multiple of engine.log_every_steps = 10" in warning
    assert "1001" in warning


def test_interval_that_is_a_multiple_of_grad_accum_is_flagged():
    warnings = cadence_warnings(EngineConfig(checkpoint_every_steps=512, grad_accum_steps=2, log_every_steps=1))
    assert len(warnings) == 1
    assert "multiple of engine.grad_accum_steps = 2" in warnings[0] and "1024 micro-steps" in warnings[0]
    assert "513" in warnings[0]


def test_both_cadences_give_two_warnings_and_one_suggestion_breaking_both():
    warnings = cadence_warnings(EngineConfig(checkpoint_every_steps=1000, grad_accum_steps=2, log_every_steps=4))
    assert len(warnings) == 2
    assert suggest_interval(1000, 4, 2) == 1001
    assert all("1001" in w for w in warnings)


def test_a_prime_interval_every_step_logging_and_no_interval_are_quiet():
    assert cadence_warnings(EngineConfig(checkpoint_every_steps=997, grad_accum_steps=2, log_every_steps=10)) == []
    # log_every_steps = 1: every step is a log step, no interval could avoid it.
    assert cadence_warnings(EngineConfig(checkpoint_every_steps=6, log_every_steps=1)) == []
    assert cadence_warnings(EngineConfig(checkpoint_every_steps=None, grad_accum_steps=4)) == []
    # A log interval that does not divide the checkpoint interval only meets it now and then.
    assert cadence_warnings(EngineConfig(checkpoint_every_steps=25, log_every_steps=10)) == []
