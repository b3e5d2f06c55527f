"""``load_from_checkpoint`` for a ``LightningModule`` from a dcpkit checkpoint folder: a helper,
and a mixin that puts it behind the classmethod."""

from __future__ import annotations

from typing import Any

from dcpkit.integrations.lightning import DcpCheckpointIO
from dcpkit.storage import open_location


def load_from_checkpoint(
    cls: Any,
    path: Any,
    map_location: Any = None,
    strict: bool | None = None,
    model_prefix: str = "",
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a dcpkit checkpoint folder (Lightning's own
    opens ``path`` as one file, with ``torch.load``): the checkpoint is verified and read by
    ``DcpCheckpointIO`` (``model_prefix`` and ``storage_options`` as given to it), then
    Lightning builds the module from its saved hyperparameters (``kwargs`` override them), calls
    its ``on_load_checkpoint`` and loads its parameters, as its own method does::

        model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")

    ``LoadsDcpCheckpoints`` puts this behind the classmethod itself."""
    from lightning.pytorch.core.saving import _load_state

    io = DcpCheckpointIO(model_prefix=model_prefix, storage_options=storage_options)
    checkpoint = io.load_checkpoint(path, map_location=map_location)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


class LoadsDcpCheckpoints:
    """A mixin for a ``LightningModule`` whose ``load_from_checkpoint`` reads dcpkit checkpoint
    folders (through ``load_from_checkpoint`` above) and anything else as Lightning does::

        class MyModule(LoadsDcpCheckpoints, L.LightningModule): ...

        model = MyModule.load_from_checkpoint("checkpoints/last.ckpt")
    """

    model_prefix = ""  # as given to the DcpCheckpointIO that wrote the checkpoints

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        store, name = open_location(checkpoint_path, kwargs.pop("storage_options", None))
        if store.holds_checkpoint(name):
            for lightning_only in ("hparams_file", "weights_only"):
                kwargs.pop(lightning_only, None)
            prefix = kwargs.pop("model_prefix", cls.model_prefix)
            return load_from_checkpoint(
                cls, checkpoint_path, map_location, model_prefix=prefix, **kwargs
            )
        return super().load_from_checkpoint(  # type: ignore[misc]
            checkpoint_path, map_location, *args, **kwargs
        )
