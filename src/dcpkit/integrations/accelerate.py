"""Hugging Face Accelerate: ``AcceleratorCheckpoint``, called in place of
``accelerator.save_state()`` / ``accelerator.load_state()``.

Accelerate's own hooks (``register_save_state_pre_hook`` and its load twin) may edit what
``save_state`` writes, not where or how: its files are written by Accelerate whatever the hook
does. So dcpkit takes the two calls' place instead: the objects ``accelerator.prepare`` returned
(model, optimizer, scheduler, dataloader) go to a ``CheckpointManager``, which saves them with
everything it adds (checksums, atomic publish, retention, async saves, exact RNG, one writer per
folder, the emergency save, resharding to any world size) and restores them. What Accelerate's
``save_state`` keeps besides is kept too: every process's RNG (dcpkit's own), the dataloader's
position (Accelerate's stateful dataloader: ``DataLoaderConfiguration(use_stateful_dataloader=
True)``) and the accelerator's own step counter; objects given to
``accelerator.register_for_checkpointing`` go in ``states``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import RandomSampler

from dcpkit.config import CheckpointConfig
from dcpkit.engine.manager import CheckpointManager


class _AcceleratorStep:
    """The accelerator's step counter (gradient accumulation), as ``save_state`` keeps it."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


def _inner(obj: Any, attribute: str) -> Any:
    """The torch object under Accelerate's wrapper (``AcceleratedOptimizer.optimizer``,
    ``AcceleratedScheduler.scheduler``), which DCP's state-dict functions need."""
    return getattr(obj, attribute, obj) if obj is not None else None


class _DataloaderState:
    """An Accelerate dataloader's position: its stateful dataloader's state (batches yielded
    this epoch), its count of epochs begun (``iteration``, from which each new iterator sets
    the sampler's epoch: ``save_state`` does not keep it) and, for Accelerate's seedable
    sampler, the sampler's epoch and seed, from which the epoch's order follows (what
    ``save_state`` keeps in ``sampler.bin``, a pickle).

    Every new iterator of a ``DataLoader`` draws a seed (its workers') from the loader's
    ``generator``, or from torch's global RNG when it has none. A run resumed in the middle of
    an epoch creates one iterator more than an uninterrupted run does (at the resume): its draw
    would move the global RNG, restored as saved, and every later random draw (dropout) would
    differ from the uninterrupted run's. The resumed run's first iterator is made with the
    global RNG left as restored, and then draws what the uninterrupted run drew at that point:
    nothing mid-epoch, one seed at an epoch's end (its next epoch's iterator). That takes
    Accelerate's wrapper, which makes its loader's iterators by calling ``__iter__``; a loader
    given unwrapped, iterated by Python itself, is given a generator of its own instead (seeded
    alike on every process). A loader's own generator has its state kept."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader
        self.loader = getattr(dataloader, "base_dataloader", dataloader)
        if self.loader is dataloader and getattr(dataloader, "generator", 0) is None:
            dataloader.generator = torch.Generator().manual_seed(0x5EED)
        sampler = dataloader.get_sampler() if hasattr(dataloader, "get_sampler") else None
        self.sampler = sampler if hasattr(sampler, "initial_seed") else None
        if not hasattr(self.loader, "state_dict"):  # Accelerate's adapter has one regardless
            raise TypeError(
                f"the dataloader ({type(dataloader).__name__}) has no state_dict(): its position "
                "would be lost on resume. Create the Accelerator with dataloader_config="
                "DataLoaderConfiguration(use_stateful_dataloader=True) (accelerate.utils), or "
                "pass dataloader=None and restore the position yourself"
            )
        if isinstance(sampler, RandomSampler) and self.sampler is None:
            raise TypeError(
                "the dataloader shuffles with a RandomSampler whose order cannot be restored: "
                "a resumed epoch would draw other batches. Add use_seedable_sampler=True to "
                "the Accelerator's DataLoaderConfiguration (each epoch's order then follows "
                "from a seed and the epoch, which the checkpoint keeps)"
            )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"loader": self.dataloader.state_dict()}
        if isinstance(getattr(self.dataloader, "iteration", None), int):
            state["iteration"] = int(self.dataloader.iteration) + self._epoch_ended()
        state["mid_epoch"] = self._in_loop() and not self._epoch_ended()
        generator = getattr(self.loader, "generator", None)
        if generator is not None:
            state["generator"] = generator.get_state()
        if self.sampler is not None:
            state["sampler_epoch"] = int(self.sampler.epoch)
            state["sampler_seed"] = int(self.sampler.initial_seed)
        return state

    def _first_iterator_draws(self, draws: int) -> None:
        """The next iterator of the loader (the resumed run's first) draws ``draws`` seeds from
        the global RNG, as restored, whatever its making takes: 0 in the middle of an epoch
        (the uninterrupted run made that epoch's iterator before the save), 1 at an epoch's end
        (the uninterrupted run's next epoch starts with one). Made from a finished epoch's
        state, the loader makes two iterators; the global RNG must see one."""
        loader = self.loader
        made = type(loader).__iter__.__get__(loader)

        def first() -> Any:
            loader.__dict__.pop("__iter__", None)  # later epochs: the loader's own, drawing
            with torch.random.fork_rng(devices=[]):
                iterator = made()
            for _ in range(draws):  # what a DataLoader iterator draws for its workers' seed
                torch.empty((), dtype=torch.int64).random_()
            return iterator

        loader.__iter__ = first  # called as ``base_dataloader.__iter__()`` by Accelerate

    def _epoch_ended(self) -> bool:
        """The epoch's last batch is out (its loader exhausted, which Accelerate's look-ahead
        knows) while the loop over it has not ended: Accelerate counts the epoch only when the
        loop ends, which a run resumed from here never reaches (its loader starts the next
        epoch), so the count is saved as the loop's end leaves it."""
        return bool(getattr(self.dataloader, "end_of_dataloader", False)) and self._in_loop()

    def _in_loop(self) -> bool:
        """A loop over the dataloader is running (Accelerate's gradient state says which)."""
        gradient = getattr(self.dataloader, "gradient_state", None)
        return getattr(gradient, "active_dataloader", None) is self.dataloader

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataloader.load_state_dict(state["loader"])
        if "iteration" in state and hasattr(self.dataloader, "iteration"):
            # Each new iterator of Accelerate's dataloader sets its sampler's epoch from its
            # own count of epochs, overriding the sampler's: without it a run stopped in its
            # second epoch resumes in the order of its first.
            self.dataloader.iteration = int(state["iteration"])
        generator = getattr(self.loader, "generator", None)
        if generator is None and "generator" in state and "mid_epoch" not in state:
            # saved by a release that gave every loader a generator: resumed as it was saved
            generator = self.loader.generator = torch.Generator()
        if generator is not None and "generator" in state:
            generator.set_state(state["generator"])
        elif generator is None and "mid_epoch" in state:
            self._first_iterator_draws(0 if state["mid_epoch"] else 1)
        if self.sampler is not None:
            if "sampler_epoch" not in state:
                raise ValueError(
                    "the checkpoint's dataloader state has no sampler epoch: it was saved "
                    "without a seedable sampler, and this run shuffles with one"
                )
            self.sampler.set_epoch(int(state["sampler_epoch"]))
            self.sampler.initial_seed = int(state["sampler_seed"])


def _registered(accelerator: Any) -> list[Any]:
    """The objects given to ``accelerator.register_for_checkpointing``, which ``save_state``
    keeps (Accelerate holds them in ``_custom_objects``)."""
    return list(getattr(accelerator, "_custom_objects", None) or [])


class AcceleratorCheckpoint:
    """Checkpoints of an Accelerate training loop, written and restored by dcpkit.

    ``base_folder`` holds ``config.folder`` (``checkpoint`` by default); ``config`` defaults to
    saving every step it is asked to (``interval=1``) with the full state at the last step too.
    ``hf_model`` (``dcpkit.HFModel("hf", model.config)`` for a ``transformers`` model) records
    the model's config, so that ``dcpkit to-hf`` exports a checkpoint without being told it.
    ``states``: more objects with ``state_dict``/``load_state_dict``, equal on every process;
    ``per_rank_states``: those that differ by process (each restored on its own rank; a resume
    at another world size refuses them). Objects given to
    ``accelerator.register_for_checkpointing`` before this is created are kept as ``states``
    (as ``save_state`` keeps them); one registered later is refused at the next save.
    """

    def __init__(
        self,
        accelerator: Any,
        base_folder: str | Path,
        model: Any,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        config: CheckpointConfig | None = None,
        states: dict[str, Any] | None = None,
        hf_model: Any = None,
        per_rank_states: dict[str, Any] | None = None,
    ) -> None:
        self.accelerator = accelerator
        if config is None:
            config = CheckpointConfig(enable=True, interval=1, last_save_model_only=False)
        named = {"accelerator": _AcceleratorStep(accelerator), **(states or {})}
        given = {id(s) for s in [*named.values(), *(per_rank_states or {}).values()]}
        self._registered = list(_registered(accelerator))
        for i, obj in enumerate(self._registered):
            if id(obj) not in given:  # as save_state keeps it: one copy, restored everywhere
                named[f"registered_{i}"] = obj
        self.manager = CheckpointManager(
            config,
            base_folder,
            model,
            _inner(optimizer, "optimizer"),
            _inner(lr_scheduler, "scheduler"),
            _DataloaderState(dataloader) if dataloader is not None else None,
            states=named,
            hf_model=hf_model,
            per_rank_states=per_rank_states,
        )

    def save_state(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        """``accelerator.save_state()``'s place: saves at ``step`` when ``config.interval``
        says so, at the last step, or when forced. Returns whether it saved."""
        if self.manager.should_save(step, last_step, force):
            self._check_accumulation(step)
        kept = {id(o) for o in self._registered}
        late = [o for o in _registered(self.accelerator) if id(o) not in kept]
        if late:
            names = ", ".join(type(o).__name__ for o in late)
            raise ValueError(
                f"{names} was given to accelerator.register_for_checkpointing after the "
                "AcceleratorCheckpoint was created, so it would not be saved: register it "
                "before, or pass it in states= (per_rank_states= when it differs by process)"
            )
        return self.manager.save(step, last_step=last_step, force=force)

    def _check_accumulation(self, step: int) -> None:
        """A save between two micro-batches of one accumulated step would lose the gradients
        accumulated so far (neither dcpkit nor ``save_state`` keeps gradients)."""
        acc = self.accelerator
        if getattr(acc, "gradient_accumulation_steps", 1) <= 1 or acc.sync_gradients:
            return
        params = (p for part in self.manager.model.parts for p in part.parameters())
        if any(p.grad is not None for p in params):
            raise ValueError(
                f"step {step} is inside an accumulated step (accelerator.sync_gradients is "
                f"False, {acc.gradient_accumulation_steps} micro-batches per step): its "
                "accumulated gradients would be lost. Save at steps where the optimizer steps "
                "(a multiple of gradient_accumulation_steps), after optimizer.zero_grad()"
            )

    def load_state(self) -> int | None:
        """``accelerator.load_state()``'s place: restores the latest published checkpoint (or
        ``config.load_step``) and returns its step; None when there is none (a fresh start)."""
        return self.manager.load()

    def maybe_wait_for_staging(self) -> None:
        """Call before ``optimizer.step()``: an async save's copy of the state must finish."""
        self.manager.maybe_wait_for_staging()

    def close(self) -> None:
        """Drain pending saves (raising their errors) and release the folder."""
        self.manager.close()

    def __enter__(self) -> AcceleratorCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
