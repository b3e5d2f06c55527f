"""The ``transformers`` ``Trainer`` (and the trainers built on it, TRL's among them) writing and
resuming its checkpoints through dcpkit::

    from dcpkit.integrations.transformers import DcpkitTrainerMixin

    class MyTrainer(DcpkitTrainerMixin, Trainer):  # or (DcpkitTrainerMixin, SFTTrainer)
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=data,
                        dcpkit_config=CheckpointConfig(async_mode="async_with_pinned_mem"))
    trainer.train(resume_from_checkpoint=True)

Each save the ``Trainer`` decides on (``save_steps``, ``save_strategy``) writes
``OUTPUT_DIR/checkpoint/step-N`` through a ``CheckpointManager``: atomic publish, manifest and
checksums, the async modes, an ``s3://`` ``output_dir``, ``save_total_limit`` as retention. A
resume restores the model, optimizer, scheduler, ``TrainerState`` (global step, epoch, log
history, best metric, the callbacks' state) and every process's RNG, each where the ``Trainer``
restores its own, so its data order (it skips the batches of the steps done) goes on exactly.

The ``Trainer`` saves and resumes through private methods of its own, which this mixin
replaces: ``train`` (to find the newest published step for ``resume_from_checkpoint=True``),
``_save_checkpoint``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_rng_state`` and ``_load_scaler``. Private methods change between releases: the mixin
runs on the ``transformers`` releases it was tested with (``TESTED``) and refuses another at
construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from dcpkit import dist
from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.console import summary
from dcpkit.engine.manager import CheckpointManager
from dcpkit.engine.states import capture_rng, rank_key, restore_rng
from dcpkit.engine.together import decided, together
from dcpkit.errors import CheckpointError
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.integrations.trainer_folders import (
    TRAINER_STEP,
    keep_tokenizer,
    link_steps,
    trainer_folders,
    trainer_state_problem,
)
from dcpkit.layout import step_name
from dcpkit.storage.opening import local_path, open_store

logger = logging.getLogger(__name__)

TESTED = ((5, 23), (5, 25))
"""The ``transformers`` releases (major, minor), first and last, whose private ``Trainer``
methods the mixin replaces were tested (the tests run the oldest and the newest, and check
their replaced methods are those of the release the suite runs)."""
TESTED_TRL = ((1, 14), (1, 16))
"""The same for TRL, whose trainers are built on ``Trainer``."""
STATE_KEY = "trainer_state"
_JSON = "json"
_PAD = 64 << 10


def installed_version(package: str = "transformers") -> str:
    """The installed release of ``package``."""
    import importlib

    return str(importlib.import_module(package).__version__)


def check_version(version: str, package: str = "transformers") -> None:
    """Refuse a release of ``package`` (``transformers`` or ``trl``) outside the tested range,
    naming it."""
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = (-1, -1)
    first, last = TESTED if package == "transformers" else TESTED_TRL
    if not first <= major_minor <= last:
        tested = ".".join(map(str, first)) + (
            "" if first == last else " to " + ".".join(map(str, last))
        )
        extra = "trainer" if package == "transformers" else "trl"
        raise ConfigError(
            f"dcpkit's Trainer integration replaces private methods of transformers' Trainer, "
            f"tested with {package} {tested}.x; this is {package} {version}. Install a tested "
            f"release (pip install 'dcpkit[{extra}]'), or checkpoint with the Trainer's own saves"
        )


def _missing_folders(output_dir: Any) -> list[Path]:
    """For an ``output_dir`` that is a URL, the local folders its text names that do not exist
    (deepest first): ``Trainer.__init__`` creates them."""
    if not output_dir or local_path(str(output_dir)) is not None:
        return []
    path = Path(str(output_dir))
    return [p for p in (path, *path.parents) if p != Path(".") and not p.exists()]


class _StagingWait(TrainerCallback):
    """A ``TrainerCallback``: before each optimizer step, wait until an asynchronous save's
    copy of the state is taken (the step would change what is being copied)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, *args: Any, **kw: Any) -> None:
        if self.trainer._dcpkit is not None:
            self.trainer._dcpkit.maybe_wait_for_staging()


class _TrainerState:
    """The ``TrainerState`` as its JSON, bytes in a tensor (nothing pickled)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # what TrainerState.save_to_json writes
        raw = (
            json.dumps(dataclasses.asdict(self.trainer.state), indent=2, sort_keys=True) + "\n"
        ).encode()
        # padded with spaces (JSON whitespace) to a multiple of 64 KiB, so that its shape, and
        # with it the save's layout, stays the same from save to save: later saves reuse the
        # first one's plans
        raw += b" " * (-len(raw) % _PAD)
        return {_JSON: torch.frombuffer(bytearray(raw), dtype=torch.uint8)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # the Trainer read it already, from the resume folder's trainer_state.json


class DcpkitTrainerMixin:
    """Put it before ``Trainer`` (or a trainer built on it) in the bases of a class of yours.

    ``dcpkit_config``: a ``CheckpointConfig`` for what the ``TrainingArguments`` do not say
    (``async_mode``, ``verify_on_load``, storage options...); its ``folder`` is taken inside
    ``output_dir``, and ``keep_latest_k`` is ``save_total_limit`` (0, keep all, when None)."""

    def __init__(self, *args: Any, dcpkit_config: CheckpointConfig | None = None, **kw: Any):
        check_version(installed_version())
        if any(c.__module__.split(".")[0] == "trl" for c in type(self).__mro__):
            check_version(installed_version("trl"), "trl")
        given = kw.get("args") or (args[1] if len(args) > 1 else None)
        local = _missing_folders(getattr(given, "output_dir", None))
        super().__init__(*args, **kw)  # type: ignore[call-arg]
        # the Trainer's saving process makes output_dir, a URL, as a local folder: undone there
        for folder in local if self.args.should_save else []:  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):  # another node's process may have removed it
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        targs = self.args  # type: ignore[attr-defined]
        refused = [
            (targs.fp16 and not targs.bf16, "fp16 (its gradient scaler's state is not kept)"),
            (targs.save_only_model, "save_only_model (a resume needs the optimizer)"),
            (getattr(self, "is_deepspeed_enabled", False), "DeepSpeed (it saves its own way)"),
        ]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"dcpkit's Trainer integration does not take {what}")
        base = dcpkit_config or CheckpointConfig()
        limit = targs.save_total_limit or 0
        if limit == 1:
            raise ConfigError(
                "save_total_limit = 1 would delete the only published step while the next is "
                "written; use 2 or more (or None to keep all)"
            )
        # the Trainer decides when to save: every call of the manager's save is one
        self.dcpkit_config = dataclasses.replace(base, enable=True, interval=1, keep_latest_k=limit)
        self._dcpkit: CheckpointManager | None = None
        self._dcpkit_resume: tuple[int, tempfile.TemporaryDirectory] | None = None
        self._dcpkit_rng: dict[str, Any] | None = None
        self.add_callback(_StagingWait(self))  # type: ignore[attr-defined]

    # -- the manager, made once the optimizer exists

    def dcpkit_manager(self) -> CheckpointManager:
        """This run's ``CheckpointManager`` (the Trainer's model, optimizer and scheduler)."""
        if self._dcpkit is None:
            from dcpkit.convert.hf_model import HFModel
            from dcpkit.convert.peft import peft_record

            model = self.model  # type: ignore[attr-defined]
            config = getattr(model, "config", None)  # a PEFT model's: its base's
            hf = None if config is None else HFModel("hf", config, peft=peft_record(model))
            self._dcpkit = CheckpointManager(
                self.dcpkit_config,
                self.args.output_dir,  # type: ignore[attr-defined]
                model,
                optimizer=getattr(self.optimizer, "optimizer", self.optimizer),  # type: ignore[attr-defined]
                lr_scheduler=getattr(self.lr_scheduler, "scheduler", self.lr_scheduler),  # type: ignore[attr-defined]
                per_rank_states={STATE_KEY: _TrainerState(self)},  # ranks' logs differ
                hf_model=hf,
            )
        return self._dcpkit

    def _store(self) -> Any:
        cfg = self.dcpkit_config
        return open_store(cfg.folder, cfg.storage_options, base=self.args.output_dir)  # type: ignore[attr-defined]

    # -- resume

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kw: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest published step
        of ``OUTPUT_DIR/checkpoint`` (a path or URL of one ``step-N`` is taken as well)."""
        if resume_from_checkpoint:  # rank 0 chooses the step; every rank fails with it
            store, given = self._store(), resume_from_checkpoint
            step = decided(lambda: self._resume_step(store, given), store.root)
            if isinstance(step, str):  # the Trainer's own checkpoint-N folder: its own load
                summary(logger, f"checkpoint: resuming from the Trainer's own {step}")
                resume_from_checkpoint = step
            else:
                where = store.location(step_name(step))
                resume_from_checkpoint = together(lambda: self._resume_folder(store, step), where)
        else:  # starting over where an earlier run saved: refused now, not at the first save
            store = self._store()
            steps = decided(store.published_steps, store.root)
            if steps:
                raise CheckpointError(
                    f"{store.root} holds step(s) {', '.join(map(str, steps[-3:]))} of an "
                    "earlier run and train() starts over: resume it with "
                    "trainer.train(resume_from_checkpoint=True) (or the checkpoint-N that "
                    "transformers.trainer_utils.get_last_checkpoint(output_dir) finds), or give "
                    "another output_dir"
                )
        try:
            return super().train(resume_from_checkpoint, *args, **kw)  # type: ignore[misc]
        finally:
            if self._dcpkit is not None:  # its last save written and published
                self._dcpkit.close()
                self._link(self._dcpkit, None)
                self._dcpkit = None

    def _resume_step(self, store: Any, resume_from_checkpoint: Any) -> int | str:
        """The step ``resume_from_checkpoint`` names: True, the newest published one (or, when
        there is none, the Trainer's own newest ``checkpoint-N`` folder, as a path). A
        ``checkpoint-N`` of ``output_dir`` names step N (``get_last_checkpoint`` finds the
        links this mixin keeps there); one that is the Trainer's own folder is its path."""
        out = local_path(str(self.args.output_dir))  # type: ignore[attr-defined]
        if resume_from_checkpoint is True:
            steps = store.published_steps()
            if steps:
                return steps[-1]
            theirs = trainer_folders(out)
            if theirs:
                return str(theirs[-1])
            raise CheckpointError(
                f"resume_from_checkpoint=True, but {store.root} holds no published step"
                + (f" and {out} no checkpoint-N folder" if out is not None else "")
            )
        name = str(resume_from_checkpoint).rstrip("/").rsplit("/", 1)[-1]
        trainer_name = TRAINER_STEP.fullmatch(name)
        if trainer_name and out is not None:
            given = Path(str(resume_from_checkpoint))
            if given.parent.resolve() != out.resolve():
                raise CheckpointError(
                    f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is not a "
                    f"checkpoint of this run's output_dir {out}: give True or one of its "
                    "checkpoint-N folders"
                )
            if given.is_dir() and not given.is_symlink():  # the Trainer's own save
                return str(given)
            name = step_name(int(trainer_name.group(1)))
            resume_from_checkpoint = store.location(name)
        if not name.startswith("step-") or not name[5:].isdigit():
            raise CheckpointError(
                f"resume_from_checkpoint={resume_from_checkpoint!r}: give True, a step-N "
                f"folder of {store.root} or a checkpoint-N of output_dir"
            )
        step = int(name[5:])
        given, own = str(resume_from_checkpoint), store.location(step_name(step))
        mine = local_path(own)
        if mine is None:
            same = given.rstrip("/") == own
        else:
            same = Path(given).resolve() == mine.resolve()
        if not same:  # a step of another folder: never this folder's step of that number
            raise CheckpointError(
                f"resume_from_checkpoint={given!r} is not a step of this run's folder "
                f"{store.root}: give True or one of its step-N folders"
            )
        return step

    def _resume_folder(self, store: Any, step: int) -> str:
        """A local folder holding the step's ``trainer_state.json`` (read from the checkpoint),
        which the Trainer reads before anything else; the rest is loaded by dcpkit."""
        from transformers.trainer import TRAINER_STATE_NAME

        name = step_name(step)
        rank = dist.rank()
        with store.view(name) as view, DCPCheckpoint(view.path, view.opener) as src:
            saved = [k for k in src.tensors if k.startswith(f"{STATE_KEY}.")]
            key = f"{STATE_KEY}.{rank_key(rank)}.{_JSON}"
            if key not in saved:  # at another world size: rank r takes rank r % saved's
                key = f"{STATE_KEY}.{rank_key(rank % max(len(saved), 1))}.{_JSON}"
            if key not in saved:
                raise CheckpointError(
                    f"{store.location(name)} holds no {STATE_KEY}: not a checkpoint of dcpkit's "
                    "Trainer integration"
                )
            raw = bytes(src.read(key).numpy().tobytes())
        problem = trainer_state_problem(raw)
        if problem is not None:
            raise CheckpointError(
                f"{store.location(name)}: its {key} cannot be the Trainer's TrainerState: {problem}"
            )
        folder = tempfile.TemporaryDirectory(prefix="dcpkit-resume-")
        (Path(folder.name) / TRAINER_STATE_NAME).write_bytes(raw)
        self._dcpkit_resume = (step, folder)
        return folder.name

    def _resuming(self, checkpoint: Any) -> bool:
        return self._dcpkit_resume is not None and checkpoint == self._dcpkit_resume[1].name

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if not self._resuming(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # else: the model is loaded with the optimizer, once it exists

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if not self._resuming(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        assert self._dcpkit_resume is not None
        manager = self.dcpkit_manager()
        manager.config.load_step = self._dcpkit_resume[0]
        manager.load()
        self._dcpkit_rng = capture_rng()  # as saved: the Trainer sets it later, where it wants

    def _link(self, manager: CheckpointManager, step: int | None) -> None:
        """``checkpoint-N`` links in a local ``output_dir`` (``trainer_folders.link_steps``)."""
        out, folder = local_path(str(self.args.output_dir)), local_path(manager.folder)  # type: ignore[attr-defined]
        if out is None or folder is None or not self.args.should_save:  # type: ignore[attr-defined]
            return
        try:
            link_steps(out, folder, step, manager.published_steps())
        except Exception as e:  # a file system without links: the steps stay step-N only
            logger.warning("checkpoint: could not link %s/checkpoint-N: %s", out, e)
        keep_tokenizer(out, getattr(self, "processing_class", None))

    def _load_best_model(self) -> None:  # load_best_model_at_end: the best step's model only
        manager = self.dcpkit_manager()
        manager.wait()
        config, best = manager.config, self.state.best_global_step  # type: ignore[attr-defined]
        saved = config.load_step, config.load_model_only
        config.load_step, config.load_model_only = best, True
        try:
            manager.load()
        finally:
            config.load_step, config.load_model_only = saved

    def _load_rng_state(self, checkpoint: Any) -> None:
        if not self._resuming(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif self._dcpkit_rng is not None:
            restore_rng(self._dcpkit_rng)

    def _load_scaler(self, checkpoint: Any) -> None:
        if not self._resuming(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    # -- save

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        from transformers.trainer_callback import ExportableState

        if getattr(self, "hp_search_backend", None) is None and trial is None:
            self.store_flos()  # type: ignore[attr-defined]
        state = self.state  # type: ignore[attr-defined]
        handler = self.callback_handler  # type: ignore[attr-defined]
        for cb in [*handler.callbacks, self.control]:  # type: ignore[attr-defined]
            if isinstance(cb, ExportableState):  # as the Trainer's own save records them
                name = type(cb).__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        manager = self.dcpkit_manager()
        if state.best_global_step:  # kept by retention as the Trainer keeps it
            state.best_model_checkpoint = manager.step_path(state.best_global_step)
        manager.best_step = state.best_global_step or None
        manager.save(state.global_step)
        self._link(manager, state.global_step)
