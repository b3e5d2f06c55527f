"""Names that make up a checkpoint on disk, in one place: file names, folder names, state groups,
dtypes. Pure definitions; the stores (``dcpkit.storage``) do the I/O.

A checkpoint folder holds ``step-N`` folders. Each is a DCP checkpoint (``.metadata`` and one
``__R_I.distcp`` file per rank's write) or a Hugging Face export, with dcpkit's manifest
``dcpkit.json``. A local save writes ``.tmp-step-N`` and publishes it by renaming it; an object
store publishes ``step-N`` by writing the commit marker last.
"""

from __future__ import annotations

import re

import torch

METADATA = ".metadata"
"""DCP's metadata file: a folder without it is not a DCP checkpoint."""
METADATA_INDEX = ".metadata.index"
"""dcpkit's index of ``.metadata`` (the same entries as data, per key): a rank's load reads the
entries of its own chunks from it instead of unpickling the whole ``.metadata``."""
MANIFEST = "dcpkit.json"
"""dcpkit's manifest: files with sizes and checksums, step, world size, versions."""
COMMIT_MARKER = ".dcpkit-committed"
"""Written last into a step folder on an object store: only then is it a checkpoint."""
DELETING = ".dcpkit-deleting"
"""Written first into a step folder on an object store that retention deletes."""
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
HF_FILES = frozenset({HF_INDEX, HF_SINGLE})
"""Either makes a folder a Hugging Face safetensors folder (an index, or a single file)."""
ADAPTER_FILE = "adapter_model.safetensors"
"""A PEFT adapter folder's weights (an export of a PEFT step: ``convert.peft``)."""
EXPORT_FILES = HF_FILES | {ADAPTER_FILE}
"""Any makes a folder a complete export."""

LEASE = ".dcpkit-lease"
"""The lease of the run saving into a checkpoint folder (see ``engine.lease``)."""

STEP_PREFIX = "step-"
STEP_DIR_RE = re.compile(r"step-(0|[1-9][0-9]*)")
"""A step's folder name, whole (``fullmatch``): ``step-`` and ASCII digits with no leading zero.
``step-00030``, ``step-٣٠`` (other scripts' digits) or ``step-30\\n`` are no step's name: read
as step 30 they would stand for a folder nobody wrote."""
TEMP_PREFIX = ".tmp-"
"""A local write in progress: ``.tmp-NAME`` becomes ``NAME`` by one rename."""
OLD_PREFIX = ".old-"
"""A local folder being deleted (renamed first, so that it never looks complete)."""
STAGING_SUFFIX = ".staging"
"""A model-only DCP save that a Hugging Face last save is converted from; never published."""


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
    """The step of a ``step-N`` name, None for any other name."""
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def staging_name(step: int) -> str:
    return f"{step_name(step)}{STAGING_SUFFIX}"


def rank_file_prefix(rank: int) -> str:
    """DCP's file system writers name the files of rank R ``__R_I.distcp``."""
    return f"__{rank}_"


RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
"""A data file of DCP's file system writers; group 1 is the rank that wrote it."""


# --- state groups: TorchTitan's top-level layout (model parameters flattened at the top) --------

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"
RNG = "rng"
NON_MODEL_GROUPS = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE, RNG, "lr_schedulers")


def is_model_key(key: str, other_groups: frozenset[str] | set[str] = frozenset()) -> bool:
    """A model parameter in TorchTitan's top-level layout: not optimizer, scheduler, ..., nor
    one of ``other_groups`` (the user states a checkpoint's manifest lists as its own groups)."""
    head = key.split(".", 1)[0]
    return head not in NON_MODEL_GROUPS and head not in other_groups


# --- dtypes --------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The floating dtypes a checkpoint can be exported or converted to, by their names."""


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
