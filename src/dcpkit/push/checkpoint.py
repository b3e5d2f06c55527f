"""``dcpkit push STEP ENGINE``: a checkpoint's step into a running engine, read a tensor at a
time through its family's key map (any step ``to-hf`` exports, TorchTitan names included), held
against the run's retention while it is read; ``--follow`` pushes each step a run publishes, in
order, until the run finishes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcpkit.console import summary
from dcpkit.convert.adapters import ConversionError
from dcpkit.convert.model_record import recorded_model, resolve_model
from dcpkit.convert.views import ToHF
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.formats.structure import refuse_broken
from dcpkit.layout import parse_step
from dcpkit.push.pusher import PushResult, WeightPusher
from dcpkit.readers import follow, held_view

logger = logging.getLogger(__name__)


def step_weights(src: DCPCheckpoint, path: Any, name: str, family: str | None, flavor: Any) -> Any:
    """The model of ``src`` by Hugging Face names (a ``ToHF`` view), as ``to_hf`` would write
    it: its family and args resolved as ``to_hf`` resolves them."""
    model = resolve_model(src, recorded_model(path), name, family, flavor, "push")
    if not model.keys:
        raise ConversionError(f"{name} holds no model parameters")
    src.check(model.keys)
    shapes = {k: src.shape(k) for k in model.keys}
    return ToHF(src, model.adapter.plan_to_hf(shapes, model.args, model.flavor, name))


def push_checkpoint(
    ckpt: str | Path,
    engine: Any,
    *,
    step: int | str | None = None,
    family: str | None = None,
    flavor: Any = None,
    version: str | None = None,
    storage_options: dict[str, Any] | None = None,
    pusher: WeightPusher | None = None,
    **options: Any,
) -> PushResult:
    """Push a step (a step folder or URL; with ``step``, a step of the checkpoint folder
    ``ckpt``, ``latest`` included) into ``engine`` as ``version`` (default: its step number)."""
    pusher = pusher or WeightPusher(engine, **options)
    with (
        held_view(ckpt, storage_options, step=step, purpose="push") as view,
        DCPCheckpoint(view.path, view.opener) as src,
    ):
        refuse_broken(view)
        weights = step_weights(src, view.path, str(ckpt), family, flavor)
        number = parse_step(view.name)
        return pusher.push_view(weights, version or (number if number is not None else None))


def push_following(
    run: str | Path,
    engine: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    poll_s: float = 1.0,
    wait_s: float | None = None,
    on_result: Callable[[str, PushResult], None] | None = None,
    **options: Any,
) -> dict[str, PushResult]:
    """Push every step the run saving into ``run`` publishes, oldest first, none twice, until
    the run finishes; each step is held from when the follower starts until it was pushed."""
    family, flavor = options.pop("family", None), options.pop("flavor", None)
    pusher = WeightPusher(engine, **options)
    done: dict[str, PushResult] = {}
    for held in follow(run, storage_options, purpose="push --follow", poll_s=poll_s,
                       wait_s=wait_s):  # fmt: skip
        result = push_checkpoint(held.location, engine, family=family, flavor=flavor,
                                 storage_options=storage_options, pusher=pusher)  # fmt: skip
        summary(logger, f"push: {held.name} -> {result.engine} as version {result.version} "
                        f"({result.bytes / 1e6:.1f} MB in {result.seconds:.2f} s)")  # fmt: skip
        done[held.name] = result
        if on_result is not None:
            on_result(held.name, result)
    return done
