"""The contract of a model-family adapter, and the engine that applies its key map.

A family file holds data (its key map, the other spellings TorchTitan has used, its flavors) and
its tensor transforms; the mapping, validation and error messages live here, once.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message names the key or option."""


@dataclass(frozen=True)
class RopePermute:
    """TorchTitan's interleaved RoPE rows -> HF's rotate-half rows, per head (and back).

    Row-local: any block of whole heads can be permuted on its own.
    """

    head_dim: int

    @property
    def row_block(self) -> int:
        return self.head_dim

    def to_hf(self, w: torch.Tensor) -> torch.Tensor:
        n = w.shape[0] // self.head_dim
        return w.reshape(n, self.head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    def from_hf(self, w: torch.Tensor) -> torch.Tensor:
        n = w.shape[0] // self.head_dim
        return w.reshape(n, 2, self.head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class ExpertOf:
    """One expert of a stacked ``[num_experts, ...]`` TorchTitan tensor, which Hugging Face
    stores as a tensor of its own per expert (``...experts.{e}...``)."""

    index: int

    @property
    def row_block(self) -> int:
        return 1

    def to_hf(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def from_hf(self, w: torch.Tensor) -> torch.Tensor:
        return w


def decoder_shapes(
    vocab: int,
    dim: int,
    n_layers: int,
    n_heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    per_layer_extra: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Shapes of a Llama-style decoder in canonical TorchTitan names."""
    shapes = {
        "tok_embeddings.weight": (vocab, dim),
        "norm.weight": (dim,),
        "output.weight": (vocab, dim),
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attention.wq.weight": (n_heads * head_dim, dim),
                p + "attention.wk.weight": (kv_heads * head_dim, dim),
                p + "attention.wv.weight": (kv_heads * head_dim, dim),
                p + "attention.wo.weight": (dim, n_heads * head_dim),
                p + "feed_forward.w1.weight": (ffn, dim),
                p + "feed_forward.w2.weight": (dim, ffn),
                p + "feed_forward.w3.weight": (ffn, dim),
                p + "attention_norm.weight": (dim,),
                p + "ffn_norm.weight": (dim,),
            }
        )
        for name, shape in (per_layer_extra or {}).items():
            shapes[p + name] = shape
    return shapes


def decoder_hf_config(
    args: Any, ffn: int, head_dim: int, dtype: torch.dtype, bos: int | None, eos: int | None
) -> dict[str, Any]:
    """The ``config.json`` fields Llama-style decoders share."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "hidden_size": args.dim,
        "intermediate_size": ffn,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": args.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


_HF_NAMED = re.compile(r"^(model\.)?(embed_tokens\.|layers\.\d+\.(self_attn|mlp)\.)")

HF_MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
HF_MODEL_TYPES["deepseek_v3"] = "deepseek_v3"
"""transformers' ``model_type`` -> the dcpkit family whose key map converts it."""


def check_model_type(family: str, config: dict[str, Any]) -> None:
    """A ``config.json`` of another family is an error that names the family to use."""
    got = config.get("model_type")
    expected = [t for t, f in HF_MODEL_TYPES.items() if f == family]
    if got is None or got in expected:
        return
    right = HF_MODEL_TYPES.get(got)
    how = (
        f"use --model {right} (the {right} family)"
        if right
        else "dcpkit has no key map for it: use --model hf, which keeps the transformers "
        "model's own parameter names"
    )
    raise ConversionError(
        f"config.json has model_type {got!r}, not {expected[0]!r} (the {family} family); {how}"
    )


def infer_family(config: dict[str, Any] | None, keys: Any = ()) -> tuple[str, str]:
    """The family of a model from its parameter names and ``config.json``: ``(family, why)``."""
    named = next((k for k in keys if _HF_NAMED.match(k)), None)
    if named is not None:
        return "hf", f"its parameters carry transformers' names ({named})"
    model_type = (config or {}).get("model_type")
    if model_type in HF_MODEL_TYPES:
        family = HF_MODEL_TYPES[model_type]
        return family, f"config.json's model_type is {model_type!r}"
    if model_type:
        return "hf", f"config.json's model_type {model_type!r} has no dcpkit key map"
    return "llama3", "TorchTitan's parameter names and no config.json to tell more (the default)"


def rotary_buffer(key: str) -> bool:
    """A rotary embedding's cached frequencies, which some exports carry as a tensor."""
    return key.endswith("rotary_emb.inv_freq")


def _compile(pattern: str) -> re.Pattern[str]:
    body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile("^" + body + "$")


def _fill(pattern: str, match: re.Match[str], expert: int | None = None) -> str:
    if "{i}" in pattern:
        pattern = pattern.replace("{i}", match.group("i"))
    if expert is not None:
        pattern = pattern.replace("{e}", str(expert))
    return pattern


@dataclass
class KeyPlan:
    """How source keys become destination keys for one conversion."""

    pairs: list[tuple[str, str, Any]]  # (source key, destination key, transform or None)
    dropped: list[tuple[str, str]]  # (source key, why)


class ModelAdapter(ABC):
    """One model family: TorchTitan names <-> Hugging Face names, transforms, config.json."""

    family: ClassVar[str]
    key_map: ClassVar[dict[str, str]]
    """Canonical TorchTitan key pattern -> HF key pattern (``{i}`` is the layer index; an HF
    pattern with ``{e}``, the expert index, stores a stacked-experts tensor one expert per key)."""
    aliases: ClassVar[dict[str, str]] = {}
    """Other TorchTitan spellings -> canonical pattern (e.g. 0.3.0's ``qkv_linear.wq``)."""
    hf_ignored: ClassVar[tuple[str, ...]] = ()
    """HF key patterns dropped on purpose when importing (e.g. rotary buffers)."""
    flavors: ClassVar[dict[str, Any]]

    def __init__(self) -> None:
        self._to_hf = [(_compile(k), v, k) for k, v in self.key_map.items()]
        self._from_hf = [(_compile(v), k) for k, v in self.key_map.items()]
        self._aliases = [(_compile(k), v) for k, v in self.aliases.items()]
        self._ignored = [_compile(p) for p in self.hf_ignored]

    # -- what a family provides

    @abstractmethod
    def args_from_hf_config(self, config: dict[str, Any]) -> Any:
        """Model args from an HF ``config.json``."""

    @abstractmethod
    def hf_config(self, args: Any, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
        """An HF ``config.json`` for ``args``."""

    @abstractmethod
    def expected_shapes(self, args: Any) -> dict[str, tuple[int, ...]]:
        """Canonical TorchTitan key -> shape, for every parameter of ``args``."""

    def transform(self, canonical_key: str, args: Any) -> Any:
        """The transform for a canonical key (``to_hf`` / ``from_hf`` / ``row_block``), or None."""
        return None

    # -- flavors

    def resolve_flavor(self, flavor: str) -> Any:
        try:
            return self.flavors[flavor]
        except KeyError:
            raise ConversionError(
                f"unknown {self.family} flavor {flavor!r}; known flavors: {', '.join(self.flavors)}"
            ) from None

    def known_flavor(self, args: Any) -> Any:
        """The named flavor ``args`` describe (whatever their context length), else ``args``."""
        for known in self.flavors.values():
            if replace(known, max_seq_len=args.max_seq_len) == args:
                return known
        return args

    def flavor_name(self, args: Any) -> str | None:
        for name, known in self.flavors.items():
            if known == args:
                return name
        return None

    # -- the engine

    def canonical(self, key: str) -> str:
        """A TorchTitan key in its canonical spelling (other dialects and ``model.`` mapped)."""
        if key.startswith("model.") and not any(r.match(key) for r, _, _ in self._to_hf):
            key = key[len("model.") :]
        for regex, target in self._aliases:
            m = regex.match(key)
            if m:
                return _fill(target, m)
        return key

    def to_hf_key(self, canonical: str, expert: int | None = None) -> str | None:
        """The HF key of ``canonical`` (of its expert ``expert`` for a stacked tensor)."""
        for regex, target, _ in self._to_hf:
            m = regex.match(canonical)
            if m:
                return _fill(target, m, expert)
        return None

    def is_stacked(self, canonical: str) -> bool:
        """Whether HF stores ``canonical`` one expert per key."""
        return any(r.match(canonical) and "{e}" in t for r, t, _ in self._to_hf)

    def from_hf_key(self, hf_key: str) -> str | None:
        found = self.from_hf_expert_key(hf_key)
        return None if found is None else found[0]

    def from_hf_expert_key(self, hf_key: str) -> tuple[str, int | None] | None:
        """``(canonical key, expert index or None)`` of an HF key, or None if unmapped."""
        for regex, target in self._from_hf:
            m = regex.match(hf_key)
            if m:
                expert = int(m.group("e")) if "e" in regex.groupindex else None
                return _fill(target, m), expert
        return None

    def _check_shapes(
        self, args: Any, shapes: dict[str, tuple[int, ...]], where: str, flavor: str
    ) -> None:
        expected = self.expected_shapes(args)
        missing = sorted(set(expected) - set(shapes))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ConversionError(
                f"{where} lacks {len(missing)} {self.family} {flavor} parameter(s): "
                f"{', '.join(missing[:5])}{more}; is the flavor right?"
            )
        for key, shape in shapes.items():
            if key in expected and tuple(shape) != tuple(expected[key]):
                raise ConversionError(
                    f"{key} in {where} has shape {list(shape)}, but {self.family} flavor "
                    f"{flavor} expects {list(expected[key])}; pass the flavor the checkpoint "
                    "was trained with"
                )

    def _unmapped(self, key: str, where: str, direction: str) -> ConversionError:
        """Every unmapped key is an error naming the key, the family and the direction."""
        target = "Hugging Face" if direction.endswith("HF") else "TorchTitan"
        return ConversionError(
            f"{key} in {where} has no {target} name in the {self.family} key map (direction: "
            f"{direction}); is it a checkpoint of another model family?"
        )

    def plan_to_hf(
        self, shapes: dict[str, tuple[int, ...]], args: Any, flavor: str, where: str
    ) -> KeyPlan:
        """Source (TorchTitan) keys with their shapes -> HF keys; errors name every problem."""
        named = next((k for k in shapes if _HF_NAMED.match(k)), None)
        if named is not None:
            raise ConversionError(
                f"{where} holds Hugging Face-named parameters (e.g. {named}): the checkpoint of "
                "a transformers model, not of TorchTitan's "
                f"{self.family}. Export it with --model hf --config CONFIG_JSON (the model's "
                "config.json)"
            )
        canon = {}
        for key in shapes:
            c = self.canonical(key)
            if c in canon:
                raise ConversionError(f"{where} holds {c} twice (as {canon[c]} and {key})")
            canon[c] = key
        self._check_shapes(args, {c: shapes[k] for c, k in canon.items()}, where, flavor)
        pairs, dropped = [], []
        for c, key in canon.items():
            if c == "output.weight" and getattr(args, "tie_word_embeddings", False):
                dropped.append((key, "tied to tok_embeddings.weight (HF omits lm_head)"))
                continue
            hf = self.to_hf_key(c)
            if hf is None:
                raise self._unmapped(key, where, "TorchTitan -> HF")
            if self.is_stacked(c):
                for e in range(shapes[key][0]):
                    pairs.append((key, self.to_hf_key(c, e), ExpertOf(e)))
                continue
            pairs.append((key, hf, self.transform(c, args)))
        return KeyPlan(pairs, dropped)

    def plan_from_hf(
        self, shapes: dict[str, tuple[int, ...]], args: Any, flavor: str, where: str
    ) -> KeyPlan:
        """HF keys with their shapes -> canonical TorchTitan keys."""
        pairs, dropped, seen = [], [], {}
        experts: dict[str, dict[int, str]] = {}
        for hf in shapes:
            if any(r.match(hf) for r in self._ignored):
                dropped.append((hf, "not a parameter (recomputed by the model)"))
                continue
            found = self.from_hf_expert_key(hf)
            if found is None:
                raise self._unmapped(hf, where, "HF -> TorchTitan")
            c, expert = found
            if expert is not None:
                experts.setdefault(c, {})[expert] = hf
                continue
            if c == "output.weight" and getattr(args, "tie_word_embeddings", False):
                dropped.append((hf, "tied embeddings: output.weight is taken from embed_tokens"))
                continue
            seen[c] = hf
            pairs.append((hf, c, self.transform(c, args)))
        if getattr(args, "tie_word_embeddings", False) and "tok_embeddings.weight" in seen:
            pairs.append((seen["tok_embeddings.weight"], "output.weight", None))
            seen["output.weight"] = seen["tok_embeddings.weight"]
        found_shapes = {c: shapes[h] for c, h in seen.items()}
        for c, members in experts.items():
            missing = sorted(set(range(max(members) + 1)) - set(members))
            if missing:
                raise ConversionError(
                    f"{where} lacks expert(s) {', '.join(map(str, missing[:8]))} of {c} "
                    f"(e.g. {self.to_hf_key(c, missing[0])}); the experts must be 0..N-1"
                )
            per_expert = {tuple(shapes[h]) for h in members.values()}
            if len(per_expert) > 1:
                raise ConversionError(f"{where}: the experts of {c} differ in shape")
            found_shapes[c] = (len(members), *per_expert.pop())
            pairs += [(members[e], c, ExpertOf(e)) for e in range(len(members))]
        self._check_shapes(args, found_shapes, where, flavor)
        return KeyPlan(pairs, dropped)
