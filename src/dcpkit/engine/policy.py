"""Pure decisions: when to save, which steps to delete, which step to load. No I/O, so each is
tested on its own and reads as the rule it implements (TorchTitan's rules, stated in its
``[checkpoint]`` options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcpkit.layout import step_name


def should_save(
    step: int,
    *,
    interval: int,
    enabled: bool = True,
    load_only: bool = False,
    first_step: bool = False,
    last_step: bool = False,
    force: bool = False,
    last_saved_step: int | None = None,
) -> bool:
    """Never when disabled or ``load_only``, nor twice for one step; else when forced, at the
    last step, at step 1 with ``enable_first_step_checkpoint``, and every ``interval`` steps."""
    if not enabled or load_only or step == last_saved_step:
        return False
    if force or last_step:
        return True
    if step == 1 and first_step:
        return True
    return step % interval == 0


def steps_to_delete(published: list[int], keep_latest_k: int, best: int | None = None) -> list[int]:
    """The oldest published steps beyond the newest ``keep_latest_k`` (0 keeps all). A
    ``best`` step (the Trainer's best model) is kept as the Trainer keeps it: counted as the
    newest but one, so ``keep_latest_k`` steps are kept, the newest and the best among them."""
    if keep_latest_k <= 0:
        return []
    ordered = sorted(published)
    if best in ordered and len(ordered) >= 2:
        ordered.remove(best)
        ordered.insert(len(ordered) - 1 if ordered[-1] > best else len(ordered), best)
    return sorted(ordered[:-keep_latest_k]) if len(ordered) > keep_latest_k else []


@dataclass(frozen=True)
class StepChoice:
    """The step to load (None: none), why, and an error to raise instead."""

    step: int | None
    reason: str
    error: str | None = None


def choose_step(published: list[int], load_step: int, folder: str) -> StepChoice:
    """``load_step`` when set (an error naming the published steps when it is not one of them);
    else the latest published step."""
    if load_step != -1:
        if load_step not in published:
            have = ", ".join(map(str, published)) or "none"
            return StepChoice(
                None,
                "",
                f"[checkpoint] load_step = {load_step}, but {folder} has no published checkpoint "
                f"{step_name(load_step)} (published steps: {have}); set load_step to one of "
                "them, or to -1 for the latest",
            )
        return StepChoice(load_step, f"load_step = {load_step}")
    if published:
        return StepChoice(max(published), f"latest published step in {folder}")
    return StepChoice(None, f"no checkpoint in {folder}")


def fallback_steps(published: list[int], failed: int) -> list[int]:
    """Where to fall back when step ``failed`` does not verify: older steps, newest first."""
    return sorted((s for s in published if s < failed), reverse=True)


def is_seed_step(step: int | None) -> bool:
    """Step 0 is a seed checkpoint: it holds the model only (TorchTitan's rule)."""
    return step == 0


def config_problem(config: Any, state_names: list[str], has_hf_model: bool) -> str | None:
    """What is wrong with ``[checkpoint]`` options for the state this run checkpoints."""
    unknown = sorted(set(config.exclude_from_loading) - set(state_names))
    if unknown:
        return (
            f"[checkpoint] exclude_from_loading names {', '.join(map(repr, unknown))}, which "
            f"this run does not checkpoint; known state keys: {', '.join(state_names)}"
        )
    if (config.initial_load_in_hf or config.last_save_in_hf) and not has_hf_model:
        return (
            "[checkpoint] initial_load_in_hf / last_save_in_hf need to know the model family: "
            "pass hf_model=HFModel(family, flavor_args) to CheckpointManager"
        )
    return None


def replacing_problem(step: int, published: list[int], resumed_from: int | None) -> str | None:
    """Whether saving ``step`` may replace a published step of that number: only the steps after
    the one this run resumed from (the future the resume abandoned, as in TorchTitan). A run
    that started fresh, or from a model-only load, would overwrite another run's checkpoint:
    the reason it may not, or None."""
    if step not in published or (resumed_from is not None and step > resumed_from):
        return None
    how = "started fresh" if resumed_from is None else f"resumed from step {resumed_from}"
    return (
        f"{step_name(step)} is already published in this checkpoint folder by an earlier run, "
        f"and this run {how} (or loaded the model only): saving would replace that run's "
        "checkpoint. Use another checkpoint folder (with [checkpoint] initial_load_path to start "
        "from a checkpoint of this one), or remove the step yourself if it is unwanted"
    )
