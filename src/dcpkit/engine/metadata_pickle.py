"""DCP's chunk lists and storage entries as pickle opcodes, written without building them.

A streamed ``.metadata`` (``described_write``) holds millions of ``ChunkStorageMetadata`` and
``MetadataIndex -> _StorageInfo`` entries. Pickling them as objects costs their construction and
a memo entry each; here each is emitted from a template, exactly the opcodes ``pickle`` emits
for it at protocol 2 (the object's class, an empty tuple, NEWOBJ, its state dict, BUILD), with
the classes and the field names defined once per section in memo slots 239-255 and the data
file names in slots from 2**20 on (out of reach of the ordinary pieces around them, whose memo
starts at 0). Unpickled, they are the same objects DCP's own pickle gives.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

_META = "torch.distributed.checkpoint.metadata"
_CHUNK, _OFFSETS, _SIZES, _SIZE_CLS, _TSM, _PROPS, _SIZE, _CHUNKS = range(240, 248)
_MI, _FQN_KEY, _INDEX_KEY, _OFFSET_KEY, _SI, _PATH_KEY, _AT_KEY, _LEN_KEY = range(248, 256)
_FQN = 239  # the current tensor's key
_PATHS = 1 << 20  # the data files' names

POP, SETITEMS, APPENDS, MARK = b"0", b"u", b"e", b"("
NEW = b")\x81}("  # EMPTY_TUPLE, NEWOBJ, EMPTY_DICT (the state), MARK
END = b"ub"  # SETITEMS, BUILD


def _get(i: int) -> bytes:
    return b"h" + bytes((i,))


def _put(i: int) -> bytes:
    return b"q" + bytes((i,))


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def string(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def integer(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes((v,))
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    n = (v.bit_length() + 8) // 8
    return b"\x8a" + bytes((n,)) + v.to_bytes(n, "little", signed=True)


_TUPLE_END = {1: b"\x85", 2: b"\x86", 3: b"\x87"}


def size(values: tuple[int, ...]) -> bytes:
    """``torch.Size(values)`` as ``torch.Size.__reduce__`` pickles it."""
    body = b"".join(integer(v) for v in values)
    n = len(values)
    tup = b")" if n == 0 else body + _TUPLE_END[n] if n <= 3 else MARK + body + b"t"
    return _get(_SIZE_CLS) + tup + b"\x85R"


def piece(obj: Any) -> bytes:
    """An ordinary object's opcodes (protocol 2, a memo of its own from slot 0)."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def chunk_header() -> bytes:
    """The classes and field names the chunk templates refer to (after any ordinary piece,
    whose memo may have overwritten them)."""
    out = [
        _global(_META, "ChunkStorageMetadata") + _put(_CHUNK),
        string("offsets") + _put(_OFFSETS),
        string("sizes") + _put(_SIZES),
        _global("torch", "Size") + _put(_SIZE_CLS),
        _global(_META, "TensorStorageMetadata") + _put(_TSM),
        string("properties") + _put(_PROPS),
        string("size") + _put(_SIZE),
        string("chunks") + _put(_CHUNKS),
    ]
    return b"".join(x + POP for x in out)


def tensor(props: Any, shape: tuple[int, ...], chunks: Any, key: Any) -> bytes:
    """A ``TensorStorageMetadata`` with every chunk (``chunks``: offsets, sizes), as DCP pickles
    it; ``key`` names the chunk list (tensors of one shape and layout share its opcodes)."""
    out = [_get(_TSM), NEW, _get(_PROPS), piece(props), _get(_SIZE), size(shape), _get(_CHUNKS)]
    return b"".join([*out, _chunk_list(key, chunks), END])


_lists: dict[Any, bytes] = {}
_keys: dict[Any, list[bytes]] = {}


def _chunk_list(key: Any, chunks: Any) -> bytes:
    found = _lists.get(key)
    if found is None:
        offsets, sizes = chunks
        out = [b"]"]  # EMPTY_LIST
        for start in range(0, len(offsets), 1000):
            out.append(MARK)
            for o, s in zip(offsets[start : start + 1000], sizes[start : start + 1000]):
                out += [_get(_CHUNK), NEW, _get(_OFFSETS), size(o), _get(_SIZES), size(s), END]
            out.append(APPENDS)
        found = _remember(_lists, key, b"".join(out))
    return found


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    if len(cache) > 512:  # a few hundred layouts at most in a model; bound it anyway
        cache.clear()
    cache[key] = value
    return value


def storage_header(files: list[str]) -> bytes:
    out = [
        _global(_META, "MetadataIndex") + _put(_MI),
        string("fqn") + _put(_FQN_KEY),
        string("index") + _put(_INDEX_KEY),
        string("offset") + _put(_OFFSET_KEY),
        _global("torch.distributed.checkpoint.filesystem", "_StorageInfo") + _put(_SI),
        string("relative_path") + _put(_PATH_KEY),
        string("offset") + _put(_AT_KEY),
        string("length") + _put(_LEN_KEY),
        _global("torch", "Size") + _put(_SIZE_CLS),
    ]
    for f, name in enumerate(files):
        out.append(string(name) + b"r" + struct.pack("<I", _PATHS + f))
    return b"".join(x + POP for x in out)


def entries(
    fqn: str, key: Any, offsets: list[Any], files: list[int], at: list[int], length: list[int]
) -> bytes:
    """``{MetadataIndex(fqn, offsets[i], i): _StorageInfo(file, at[i], length[i])}`` items,
    SETITEMS applying them to the dict on top of the stack. ``key`` names the chunk list: each
    chunk's ``MetadataIndex`` refers to the key through a memo slot, so tensors of one shape
    and layout share their opcodes."""
    keys = _keys.get(key)
    if keys is None:
        keys = _remember(_keys, key, [_entry_start(i, o) for i, o in enumerate(offsets)])
    pack, at_key, len_key = struct.Struct("<I").pack, _get(_AT_KEY), _get(_LEN_KEY)
    out = [string(fqn), _put(_FQN), POP]
    for start in range(0, len(offsets), 1000):
        out.append(MARK)
        for i in range(start, min(start + 1000, len(offsets))):
            out += [
                keys[i], pack(_PATHS + files[i]), at_key, integer(at[i]), len_key,
                integer(length[i]), END,
            ]  # fmt: skip
        out.append(SETITEMS)
    return b"".join(out)


def _entry_start(i: int, offsets: tuple[int, ...]) -> bytes:
    """A chunk's ``MetadataIndex`` and its ``_StorageInfo`` up to the file's memo slot."""
    key = [_get(_MI), NEW, _get(_FQN_KEY), _get(_FQN), _get(_INDEX_KEY), integer(i)]
    key += [_get(_OFFSET_KEY), size(offsets), END]
    return b"".join([*key, _get(_SI), NEW, _get(_PATH_KEY), b"j"])
