"""The training-shard format (version 2): WebDataset tar files of batch records, and the manifest beside them.

One tar record = one batch of exactly B samples for one worker (the last batch of a split other than ``train`` may
be smaller: it holds the split's remainder, so that evaluation scores every sample; its ``meta.samples`` says so). Its members (basename = the record key, a
zero-padded batch index with no dots) are ``.npy`` arrays and one ``.json`` header; never pickle. Field names as
consumers see them after :func:`decode_sample` (stored dtypes may be narrower, see below):

common to every task
    ``meta.json``            {"index", "split", "task", "samples", "micro_batches"[, "packed"]}
    ``mb.npy``               int32 [B]   micro-batch id of each sample (the key-centric clustering's partition)
per sparse table ``t`` listed in the manifest (jagged: sample s owns values[off[s]:off[s+1]], off = cumsum(lengths))
    ``t.values.npy``         int64 [nnz] raw ids as read (the trainer maps out-of-vocabulary ids by its own rule)
    ``t.lengths.npy``        int32 [B]
    ``t.unique.npy``         int64 [U]   the batch's sorted unique ids of this table
    ``t.inverse.npy``        int32 [nnz] position of every value in ``t.unique`` (unique[inverse] == values)
    ``t.mb_unique.npy``      int32 [sum_i U_i] for each micro-batch i, its sorted unique ids as positions into
                                         ``t.unique``, concatenated in micro-batch order
    ``t.mb_offsets.npy``     int64 [N+1] micro-batch i owns mb_unique[mb_offsets[i]:mb_offsets[i+1]]
task ``gr`` (generative recommendation; one sample = a chronological window of one user's interactions)
    ``user.npy``             int64 [B]
    ``time.npy``             int64 [nnz] interaction time, epoch milliseconds
    ``play.npy``             int64 [nnz] play_time_ms
    ``duration.npy``         int64 [nnz] duration_ms (``play`` and ``duration`` stored as int32 when they fit)
    In the ``eval`` split the last token of every sample is the held-out next interaction (leave-one-out).
    The sequence tables (``item``, ``author``, ``action``) travel in one packed group ``seq``; ``mb.npy`` is
    stored as uint8 when N <= 256.
task ``ctr`` (one sample = one interaction)
    ``dense.npy``            float32 [B, D] (names in manifest ``dense_features``)
    ``labels.npy``           float32 [B, K] (names in manifest ``labels``); stored as uint8 0/1
    ``mb.npy`` is stored as uint8 when N <= 256. The sparse tables travel in two packed groups: ``single`` (every
    single-id table) and ``bags`` (``tag`` and ``history``).

Packed table groups: many small tables would cost six tar members each, so a record may store a group ``g`` of
T tables in at most six members (``meta.json`` lists the tables of each group under ``packed``):

    ``g.unique``             int32 (when every id fits, else int64) [sum_t U_t] each table's sorted unique ids,
                             table after table
    ``g.unique_counts``      int64 [T]   U_t
    ``g.inverse``            uint16 (when every U_t <= 65536, else int32) [sum_t nnz_t], table after table
    ``g.mb_unique``          same dtype as ``g.inverse``, [sum_t sum_i U_ti], table after table
    ``g.mb_offsets``         int64 [T, N+1] per table, relative to the table's run of ``g.mb_unique``
    ``g.lengths``            uint8 (when every length < 256, else int32) [T, B]; ABSENT when every sample holds
                             exactly one id of every table (single-id tables), which readers then assume

Values are not stored in a group: readers rebuild ``values = unique[inverse]`` per table (exact, since ``inverse``
indexes the sorted unique ids). :func:`decode_sample` and :func:`iter_shard` unpack groups and widen the stored
dtypes, so consumers always see the per-table fields and dtypes listed above. Version 1 shards (values stored,
wide dtypes, bags unpacked) are refused with a message asking to re-run the ingest.

Tar members carry a pinned mtime, uid, gid and mode so the bytes depend only on the content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import tarfile
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from nestpipe.utils.jsonio import JSONFileError, read_json, write_json_atomic

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
TABLE_FIELDS = ("values", "lengths", "unique", "inverse", "mb_unique", "mb_offsets")
FIELD_DTYPES = {
    "values": np.int64, "lengths": np.int32, "unique": np.int64, "inverse": np.int32,
    "mb_unique": np.int32, "mb_offsets": np.int64,
}
_PINNED_MTIME = 0


class ShardError(ValueError):
    """A shard or manifest is missing, corrupt or of a format this version cannot read."""


Batch = Dict[str, Any]  # field name ("meta", "mb", "item.values", ...) -> np.ndarray or dict for "meta"


def _npy_bytes(arr: np.ndarray) -> memoryview:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getbuffer()  # no copy of the array bytes


# GR per-token fields stored as int32 when every value fits (play and duration times in ms); read back as int64
GR_NARROW_FIELDS = ("play", "duration")


def narrow_int(arr: np.ndarray) -> np.ndarray:
    """int32 when every value fits, else int64."""
    arr = np.asarray(arr)
    return arr.astype(_id_dtype(arr))


def encode_record(key: str, batch: Batch) -> List[Tuple[str, bytes]]:
    """Tar members of one batch record, in a fixed (sorted) order."""
    if "." in key:
        raise ValueError(f"record key {key!r} must not contain dots")
    members = []
    for field in sorted(batch):
        value = batch[field]
        if field == "meta":
            members.append((f"{key}.meta.json", json.dumps(value, sort_keys=True).encode()))
        else:
            arr = np.asarray(value)
            if arr.dtype == object:
                raise TypeError(f"field {field!r}: object arrays would need pickle; refusing")
            members.append((f"{key}.{field}.npy", _npy_bytes(arr)))
    return members


class _HashingWriter:
    """File-like sink that hashes and counts every byte written (so the shard is not read back for its sha256)."""

    def __init__(self, raw):
        self.raw = raw
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, b) -> int:
        self.hash.update(b)
        self.size += len(b)
        return self.raw.write(b)

    def tell(self) -> int:
        return self.size


def _member_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _PINNED_MTIME
    info.mode = 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_shard(path: str, records: Iterable[Tuple[str, Batch]]) -> Tuple[str, int]:
    """Write a tar shard atomically (temporary name, fsync, rename). Returns (sha256 hex, size in bytes).

    webdataset's ``TarWriter`` stamps members with the current time; NestPipe needs byte-identical output for
    identical input, so members carry pinned metadata. Headers are :mod:`tarfile`'s own (``TarInfo.tobuf``, USTAR);
    the member bytes are written in one piece each instead of through ``TarFile.addfile``, whose copy loop moves
    16 KiB at a time (a third of the shard stage's writing time here). The bytes are exactly what ``addfile`` and
    ``close`` write (tests/test_shards_format.py compares them).
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    block, record = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
    with open(tmp, "wb") as raw:
        sink = _HashingWriter(raw)
        for key, batch in records:
            for name, data in encode_record(key, batch):
                sink.write(_member_info(name, len(data)).tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING,
                                                                "surrogateescape"))
                sink.write(data)
                if len(data) % block:
                    sink.write(bytes(block - len(data) % block))
        sink.write(bytes(2 * block))  # end-of-archive marker
        if sink.size % record:
            sink.write(bytes(record - sink.size % record))
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    return sink.hash.hexdigest(), sink.size


def write_split_shards(out: str, splits: Sequence[Tuple[str, Sequence[int]]], batch_size: int,
                       make_record: Callable[[str, int], Batch]) -> Dict[str, List["ShardEntry"]]:
    """Write the shards of every split: ``splits`` lists (split, batches of each shard); batch records come from
    ``make_record(split, index)``, ``index`` counting batches over all splits (record key ``f"{index:08d}"``), in
    order. Returns the manifest's ``sets``."""
    os.makedirs(out, exist_ok=True)
    sets: Dict[str, List[ShardEntry]] = {}
    index = 0
    for split, counts in splits:
        entries = []
        for si, nb in enumerate(counts):
            recs = []
            for _ in range(nb):
                recs.append((f"{index:08d}", make_record(split, index)))
                index += 1
            name = f"{split}-{si:06d}.tar"
            digest, size = write_shard(os.path.join(out, name), recs)
            entries.append(ShardEntry(name, nb, nb * batch_size, digest, size))
        sets[split] = entries
    return sets


def sha256_file(path: str, chunk: int = 1 << 20) -> Tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
            size += len(b)
    return h.hexdigest(), size


def _index_dtype(bound: int):
    """Narrowest dtype of the stored position arrays for positions in ``0..bound-1``."""
    return np.uint16 if bound <= (1 << 16) else np.int32


def _id_dtype(arr: np.ndarray):
    if arr.size == 0 or (int(arr.min()) >= -(1 << 31) and int(arr.max()) < (1 << 31)):
        return np.int32
    return np.int64


def pack_group(batch: Batch, group: str, tables: List[str], unique: np.ndarray, unique_counts: np.ndarray,
               inverse: np.ndarray, mb_unique: np.ndarray, mb_offsets: np.ndarray,
               lengths: Optional[np.ndarray]) -> Batch:
    """Store packed group ``group`` of ``tables`` from its concatenated (table after table) arrays, in place.

    ``lengths`` is int [T, B], or None when every sample holds exactly one id of every table (then no lengths
    member is written). Values are not stored: readers rebuild them as ``unique[inverse]`` per table.
    """
    counts = np.asarray(unique_counts, np.int64)
    bound = int(counts.max()) if len(counts) else 0
    idx = _index_dtype(bound)
    unique = np.asarray(unique)
    batch[f"{group}.unique"] = unique.astype(_id_dtype(unique))
    batch[f"{group}.unique_counts"] = counts
    batch[f"{group}.inverse"] = np.asarray(inverse).astype(idx)
    batch[f"{group}.mb_unique"] = np.asarray(mb_unique).astype(idx)
    batch[f"{group}.mb_offsets"] = np.asarray(mb_offsets, np.int64)
    if lengths is not None and not (lengths.size and np.all(lengths == 1)):
        lengths = np.asarray(lengths)
        batch[f"{group}.lengths"] = lengths.astype(np.uint8 if lengths.size == 0 or lengths.max() < 256
                                                   else np.int32)
    meta = batch.setdefault("meta", {})
    meta.setdefault("packed", {})[group] = list(tables)
    return batch


def pack_tables(batch: Batch, group: str, tables: List[str]) -> Batch:
    """Replace the per-table fields of ``tables`` by the members of packed group ``group`` (in place)."""
    if not tables:
        return batch
    def take(t: str, f: str) -> np.ndarray:
        return np.asarray(batch.pop(f"{t}.{f}"))
    cols = {f: [take(t, f) for t in tables] for f in TABLE_FIELDS}
    for t, u, inv, v in zip(tables, cols["unique"], cols["inverse"], cols["values"]):
        if not np.array_equal(u[inv], v):
            raise ValueError(f"table {t!r}: unique[inverse] != values; values are not stored in a packed group")
    return pack_group(batch, group, tables, np.concatenate(cols["unique"]),
                      np.array([len(u) for u in cols["unique"]], np.int64), np.concatenate(cols["inverse"]),
                      np.concatenate(cols["mb_unique"]), np.stack(cols["mb_offsets"]),
                      np.stack(cols["lengths"]))


def unpack_tables(batch: Batch, values: bool = True) -> Batch:
    """Inverse of :func:`pack_tables` for every group listed in ``meta["packed"]`` (in place): per-table fields
    with the dtypes of the per-table layout (values and unique int64, lengths/inverse/mb_unique int32).

    ``values=False`` leaves out ``{t}.values`` (``unique[inverse]``, a gather over every key occurrence) and its
    bounds check, for a reader that works from ``unique`` and ``inverse`` and checks the inverse indices itself
    (the trainer's ``prepare_batch``: its compiled pass over the values fails on an index outside the keys)."""
    packed = batch.get("meta", {}).get("packed") or {}
    b = len(batch["mb"]) if "mb" in batch else None
    for group, tables in packed.items():
        try:
            unique = batch.pop(f"{group}.unique").astype(np.int64, copy=False)
            counts = batch.pop(f"{group}.unique_counts")
            inverse = batch.pop(f"{group}.inverse").astype(np.int32, copy=False)
            mb_unique = batch.pop(f"{group}.mb_unique").astype(np.int32, copy=False)
            mb_offsets = batch.pop(f"{group}.mb_offsets").astype(np.int64, copy=False)
        except KeyError as e:
            raise ShardError(f"packed group {group!r} lacks member {e.args[0]!r}") from None
        lengths = batch.pop(f"{group}.lengths", None)
        if lengths is None:
            if b is None:
                raise ShardError(f"packed group {group!r} has no lengths and the record no mb member")
            lengths = np.ones((len(tables), b), np.int32)
        lengths = lengths.astype(np.int32)
        if lengths.shape[0] != len(tables) or mb_offsets.shape[0] != len(tables) or len(counts) != len(tables):
            raise ShardError(f"packed group {group!r}: shapes do not match its {len(tables)} tables")
        nnz = lengths.astype(np.int64).sum(axis=1)
        v_off = np.concatenate([[0], np.cumsum(nnz)])
        u_off = np.concatenate([[0], np.cumsum(counts)])
        m_off = np.concatenate([[0], np.cumsum(mb_offsets[:, -1])])
        if v_off[-1] != len(inverse) or u_off[-1] != len(unique) or m_off[-1] != len(mb_unique):
            raise ShardError(f"packed group {group!r}: member sizes do not add up")
        for i, t in enumerate(tables):
            u = unique[u_off[i]:u_off[i + 1]]
            inv = inverse[v_off[i]:v_off[i + 1]]
            if values:
                if len(inv) and (inv.min() < 0 or inv.max() >= len(u)):
                    raise ShardError(f"packed group {group!r}: table {t!r} has inverse indices outside its unique "
                                     "keys")
                batch[f"{t}.values"] = u[inv]
            batch[f"{t}.lengths"] = lengths[i]
            batch[f"{t}.unique"] = u
            batch[f"{t}.inverse"] = inv
            batch[f"{t}.mb_unique"] = mb_unique[m_off[i]:m_off[i + 1]]
            batch[f"{t}.mb_offsets"] = mb_offsets[i]
    return batch


def decode_sample(sample: Dict[str, Any], values: bool = True) -> Batch:
    """Turn a decoded WebDataset sample (``.decode()`` output) into a batch dict keyed by field name, with
    packed table groups unpacked into per-table fields (``values``: see :func:`unpack_tables`)."""
    out: Batch = {}
    for k, v in sample.items():
        if k.startswith("__"):
            continue
        if k == "meta.json":
            out["meta"] = v if isinstance(v, dict) else json.loads(v)
        elif k.endswith(".npy"):
            out[k[: -len(".npy")]] = v
    if "mb" in out:
        out["mb"] = np.asarray(out["mb"]).astype(np.int32, copy=False)
    if "labels" in out:
        out["labels"] = np.asarray(out["labels"]).astype(np.float32, copy=False)
    for f in GR_NARROW_FIELDS:
        if f in out:
            out[f] = np.asarray(out[f]).astype(np.int64, copy=False)
    return unpack_tables(out, values=values)


def iter_shard(path: str) -> Iterator[Batch]:
    """Read one shard with stock WebDataset (no pickle decoders involved for .npy/.json)."""
    import webdataset as wds  # start-up time: WebDataset imports torch, which writing shards never needs

    if not os.path.exists(path):
        raise ShardError(f"{path}: shard missing")
    ds = wds.WebDataset(path, shardshuffle=False, empty_check=False).decode()
    count = 0
    try:
        for sample in ds:
            yield decode_sample(sample)
            count += 1
    except (OSError, ValueError, tarfile.TarError) as e:  # a truncated or corrupt tar: one line naming the shard
        if isinstance(e, ShardError):
            raise
        raise ShardError(f"{path}: cannot read the shard after {count} batch(es) ({type(e).__name__}: {e}); "
                         "`nestpipe shard-report` verifies every shard's checksum") from e


@dataclasses.dataclass
class TableSpec:
    """A sparse table: vocabulary size (ids >= vocab are hashed into it by the trainer), default dim, kind.

    kind: ``sequence`` (jagged tokens; rows travel deduplicated: unique-based exchange) or ``pooled``
    (multi-hot bag per sample; the owner may pool: reduction-based exchange) or ``single`` (one id per sample).
    """

    vocab: int
    dim: int = 64
    kind: str = "sequence"


@dataclasses.dataclass
class ShardEntry:
    path: str  # relative to the manifest's directory
    batches: int
    samples: int
    sha256: str
    bytes: int


@dataclasses.dataclass
class Manifest:
    task: str
    batch_size: int
    micro_batches: int
    tables: Dict[str, TableSpec]
    sets: Dict[str, List[ShardEntry]]
    format_version: int = FORMAT_VERSION
    max_seq_len: Optional[int] = None
    dense_features: List[str] = dataclasses.field(default_factory=list)
    labels: List[str] = dataclasses.field(default_factory=list)
    rejected_rows: int = 0
    rejects_file: Optional[str] = None
    dropped_samples: Dict[str, int] = dataclasses.field(default_factory=dict)
    inputs: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def totals(self) -> Dict[str, Dict[str, int]]:
        return {
            name: {
                "shards": len(entries),
                "batches": sum(e.batches for e in entries),
                "samples": sum(e.samples for e in entries),
                "bytes": sum(e.bytes for e in entries),
            }
            for name, entries in self.sets.items()
        }

    def to_json(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["totals"] = self.totals()
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], where: str = "manifest") -> "Manifest":
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ShardError(
                f"{where}: shard format version {version!r}, this NestPipe reads version {FORMAT_VERSION}; "
                "re-run `nestpipe ingest` with this version"
            )
        d = dict(d)
        d.pop("totals", None)
        d["tables"] = {k: TableSpec(**v) for k, v in d["tables"].items()}
        d["sets"] = {k: [ShardEntry(**e) for e in v] for k, v in d["sets"].items()}
        return cls(**d)


def save_manifest(directory: str, manifest: Manifest) -> str:
    path = os.path.join(directory, MANIFEST_NAME)
    return write_json_atomic(path, manifest.to_json(), fsync=True)


def load_manifest(directory: str) -> Manifest:
    path = directory if directory.endswith(".json") else os.path.join(directory, MANIFEST_NAME)
    if not os.path.exists(path):
        raise ShardError(f"{path}: no manifest (is this the output directory of `nestpipe ingest`?)")
    try:
        d = read_json(path, "manifest", expect=dict)
    except JSONFileError as e:
        raise ShardError(f"{path}: corrupt manifest: {e.__cause__ or e}") from e
    return Manifest.from_json(d, where=path)


def shard_paths(directory: str, manifest: Manifest, split: str) -> List[str]:
    if split not in manifest.sets:
        raise ShardError(f"{directory}: manifest has no {split!r} set (sets: {sorted(manifest.sets)})")
    return [os.path.join(directory, e.path) for e in manifest.sets[split]]


def verify_shard(directory: str, entry: ShardEntry) -> None:
    """Check one shard's presence and sha256 against the manifest; raise naming the shard."""
    path = os.path.join(directory, entry.path)
    if not os.path.exists(path):
        raise ShardError(f"{path}: shard listed in the manifest is missing")
    digest, size = sha256_file(path)
    if digest != entry.sha256 or size != entry.bytes:
        raise ShardError(
            f"{path}: shard is corrupt (sha256 {digest[:12]}..., {size} bytes; manifest says "
            f"{entry.sha256[:12]}..., {entry.bytes} bytes)"
        )


def table_offsets(batch: Batch, table: str) -> np.ndarray:
    """int64 [B+1] offsets of a table's jagged values."""
    lengths = batch[f"{table}.lengths"].astype(np.int64)
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off
