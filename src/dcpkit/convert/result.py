"""What a conversion says it did: counts, time, what it dropped, what it verified."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcpkit.units import human_bytes


@dataclass
class ConversionResult:
    output: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dropped: list[tuple[str, str]] = field(default_factory=list)
    flavor: str = ""
    max_tensor_diff: float | None = None
    max_logits_diff: float | None = None
    """The export's logits (transformers) against the source checkpoint's model's."""
    logits_tolerance: float | None = None
    logits_tolerance_why: str = ""
    max_implementation_diff: float | None = None
    """A rounded export: transformers against dcpkit's model, both on the exported weights."""
    notes: list[str] = field(default_factory=list)

    def lines(self, verb: str) -> list[str]:
        """What the command line prints about this conversion."""
        out = [
            f"{verb}: {self.tensors} tensors, {human_bytes(self.bytes)} -> {self.output} "
            f"in {self.seconds:.1f}s"
        ]
        if self.flavor:
            out.append(f"  flavor: {self.flavor}")
        out += [f"  dropped {key}: {why}" for key, why in self.dropped]
        if self.max_tensor_diff is not None:
            out.append(
                "  verified: every tensor read back matches; max abs diff vs source "
                f"{self.max_tensor_diff:.3g}"
            )
        if self.max_implementation_diff is not None:
            out.append(
                "  verified: transformers runs the exported weights as dcpkit's model does, max "
                f"abs diff of the logits {self.max_implementation_diff:.3g} (tolerance 1e-4)"
            )
        if self.max_logits_diff is not None:
            out.append(
                "  verified: transformers logits of the export vs the source checkpoint's model, "
                f"max abs diff {self.max_logits_diff:.3g}, within the tolerance "
                f"{self.logits_tolerance:.3g} ({self.logits_tolerance_why})"
            )
        return out + [f"  note: {note}" for note in self.notes]
