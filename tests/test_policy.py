"""The pure rules: when to save, what retention deletes, which step a load picks."""

from __future__ import annotations

from dcpkit.engine.policy import choose_step, fallback_steps, should_save, steps_to_delete


def test_steps_to_delete_keeps_the_newest():
    assert steps_to_delete([5, 1, 3, 4, 2], keep_latest_k=2) == [1, 2, 3]
    assert steps_to_delete([1, 2], keep_latest_k=2) == []
    assert steps_to_delete([1, 2, 3], keep_latest_k=0) == []  # 0 keeps all
    # the best step (the Trainer's) counts as the newest but one: kept with the newest
    assert steps_to_delete([3, 6, 9, 12], keep_latest_k=2, best=3) == [6, 9]
    assert steps_to_delete([3, 6, 9, 12], keep_latest_k=3, best=3) == [6]
    assert steps_to_delete([3, 6, 9, 12], keep_latest_k=2, best=12) == [3, 6]
    assert steps_to_delete([3, 6, 9, 12], keep_latest_k=2, best=7) == [3, 6]  # not published


def test_should_save():
    rule = {"interval": 5}
    assert [s for s in range(1, 12) if should_save(s, **rule)] == [5, 10]
    assert should_save(1, **rule, first_step=True)
    assert should_save(7, **rule, last_step=True) and should_save(7, **rule, force=True)
    assert not should_save(10, **rule, last_saved_step=10)  # never twice for one step
    assert not should_save(10, **rule, load_only=True, force=True)
    assert not should_save(10, **rule, enabled=False, last_step=True)


def test_choose_step():
    assert choose_step([2, 4], -1, "ckpt").step == 4
    choice = choose_step([], -1, "ckpt")
    assert choice.step is None and choice.error is None
    assert choose_step([2, 4], 2, "ckpt").step == 2
    error = choose_step([2, 4], 3, "ckpt").error
    assert "load_step = 3" in error and "step-3" in error and "published steps: 2, 4" in error


def test_fallback_goes_to_older_steps_newest_first():
    assert fallback_steps([1, 2, 3, 4], failed=3) == [2, 1]
    assert fallback_steps([3], failed=3) == []


def test_a_save_replaces_only_steps_after_the_one_resumed_from():
    from dcpkit.engine.policy import replacing_problem

    assert replacing_problem(4, [2, 6], None) is None  # not published: nothing replaced
    assert replacing_problem(6, [2, 6], resumed_from=2) is None  # load_step 2: 6 is abandoned
    fresh = replacing_problem(6, [2, 6], None)
    assert "step-6 is already published" in fresh and "started fresh" in fresh
    assert "resumed from step 6" in replacing_problem(6, [2, 6], resumed_from=6)
