"""Export: the whole model as one plain dict of name -> full, unsharded tensor (``torch.load(weights_only=True)``).

Names
- ``embedding.<table>.weight`` ``[V, D]`` and ``embedding.<table>.adagrad_state`` ``[V]``, rows indexed by the
  in-vocabulary id (the placement is undone; rows never touched hold their deterministic initial value); a table
  trained split into ``c`` column shards has its columns joined back and ``adagrad_state`` ``[V, c]`` (each column
  shard's own row-wise state, in column order);
- ``dense.<parameter>``; ``optim.dense.<parameter>.{exp_avg,exp_avg_sq,step}`` (AdamW).

The result does not depend on the world size that trained it. For tables above ``max_rows_in_memory`` rows,
:func:`export_run` streams: ``FILE.pt`` then holds everything else plus ``embedding.<table>.files`` metadata, and each
large table is written as ``FILE.<table>.<block>.pt`` files of consecutive id blocks.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch

from nestpipe.trainer import checkpoint
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.embedding.placement import TablePlacement, init_rows
from nestpipe.trainer.models import build_model, model_table_dims
from nestpipe.trainer.run_files import run_manifest
from nestpipe.utils.jsonio import write_json_atomic


def _tables(placement: Dict[str, Dict]) -> Dict[str, List[Tuple[str, Dict]]]:
    """A checkpoint's stores grouped by table: ``table -> [(store, its placement meta)]`` in column order (one store
    per table unless it was split by columns)."""
    out: Dict[str, List[Tuple[str, Dict]]] = {}
    for store, pm in sorted(placement.items()):
        out.setdefault(pm.get("table", store), []).append((store, pm))
    return {t: sorted(v, key=lambda x: x[1].get("first_col", 0)) for t, v in sorted(out.items())}


def _table_blocks(ckpt: str, parts: List[Tuple[str, Dict]], seed: int, rank_files: Dict[int, Dict],
                  block: int) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    """``(first id, weights [n, D], AdaGrad state [n] or [n, c])`` of one table, ``block`` ids at a time: its column
    shards' blocks joined column-wise."""
    gens = [_store_blocks(ckpt, name, pm, seed, rank_files, block) for name, pm in parts]
    if len(gens) == 1:
        yield from gens[0]
        return
    for blocks in zip(*gens):
        yield blocks[0][0], torch.cat([w for _, w, _ in blocks], 1), torch.stack([st for _, _, st in blocks], 1)


def _store_blocks(ckpt: str, name: str, pmeta: Dict, seed: int, rank_files: Dict[int, Dict],
                  block: int) -> Iterator[Tuple[int, torch.Tensor, torch.Tensor]]:
    pl = TablePlacement(pmeta["table_id"], pmeta["vocab"], pmeta["world"], pmeta["a"], pmeta["b"],
                        tuple(pmeta.get("owners", ())))
    dim, R = pmeta["dim"], pl.rows_per_rank
    # dense local->value maps per rank (materialised rows only)
    per_rank = {}
    for r in range(pl.world):
        per_rank[r] = _rank_rows(ckpt, rank_files[r]["tables"][name])
    dtype = table_dtype(rank_files[0]["tables"][name])
    for start in range(0, pl.vocab, block):
        ids = np.arange(start, min(pl.vocab, start + block), dtype=np.int64)
        w = torch.from_numpy(init_rows(seed, pl.table_id, ids, dim, pmeta["init_scale"],
                                       pmeta.get("first_col", 0))).to(dtype)
        s = torch.zeros(len(ids), dtype=dtype)
        owner, local = pl.owner_and_row(ids)
        for r, (rows, rw, rs, by_row) in per_rank.items():
            sel = np.nonzero(owner == r)[0]
            if not len(sel) or not len(rows):
                continue
            pos = np.searchsorted(rows, local[sel])
            pos_c = np.minimum(pos, len(rows) - 1)
            hit = rows[pos_c] == local[sel]
            if hit.any():
                dst = torch.from_numpy(sel[hit])
                # rows saved in the payload are indexed by their position, a row file snapshot by the row itself
                src = torch.from_numpy(rows[pos_c[hit]] if by_row else pos_c[hit])
                w.index_copy_(0, dst, rw.index_select(0, src))
                s.index_copy_(0, dst, rs.index_select(0, src))
        yield start, w, s


def table_dtype(entry: Dict) -> torch.dtype:
    """The dtype of a checkpointed store (a row file snapshot of the memory-mapped tier is float32)."""
    return torch.float32 if "snapshot" in entry else entry["weight"].dtype


def _rank_rows(ckpt: str, entry: Dict):
    """(materialised rows ascending, weights, states, indexed by row?) of one store in one rank's checkpoint: the
    payload's tensors, or the memory-mapped row files of a snapshot (read as the export's blocks need them)."""
    if "snapshot" not in entry:
        return entry["rows"].numpy(), entry["weight"], entry["state"], False
    n, dim = int(entry["rows_total"]), int(entry["dim"])
    w = np.memmap(os.path.join(ckpt, entry["snapshot"][0]), dtype=np.float32, mode="c", shape=(n, dim))
    st = np.memmap(os.path.join(ckpt, entry["snapshot"][1]), dtype=np.float32, mode="c", shape=(n,))
    rows = torch.nonzero(entry["materialized"]).flatten().numpy()
    return rows, torch.from_numpy(w), torch.from_numpy(st), True


def assemble(run: str, ckpt: str = None, max_rows_in_memory: int = 50_000_000) -> Dict[str, torch.Tensor]:
    """Full tensors of a run's latest (or given) checkpoint, in memory."""
    out, _ = _assemble(run, ckpt, None, max_rows_in_memory)
    return out


def _check_replicas(ckpt: str, rank_files: Dict[int, Dict]) -> None:
    """The export takes rank 0's replicated tables, dense parameters and AdamW state; every rank's recorded digest of
    its own copy must match them bit for bit (the all-reduced gradients and identical updates guarantee it), else
    the replicas diverged and there is no single model to export. Checkpoints written before the digests: no check."""
    digests = {r: p.get("replica_digest") for r, p in rank_files.items()}
    if any(d is None for d in digests.values()):
        return
    mine = checkpoint.replica_digest(rank_files[0])
    bad = [r for r, d in sorted(digests.items()) if d != mine]
    if bad:
        raise ValueError(f"{ckpt}: the data-parallel copy (replicated tables, dense parameters, AdamW state) of "
                         f"rank(s) {bad} differs from the one rank 0 saved: the replicas diverged, so there is no "
                         "single model to export")


def _open_checkpoint(run: str, ckpt: str = None):
    """(config, checkpoint directory, its meta, every rank's file) of ``run``'s latest (or the given) checkpoint,
    after checking that the data-parallel replicas agree (:func:`_check_replicas`)."""
    cfg = load_run_config(run)
    ckpt = ckpt or checkpoint.latest(run)
    if ckpt is None:
        raise FileNotFoundError(f"{run}: no complete checkpoint (train first)")
    meta = checkpoint.read_meta(ckpt)
    rank_files = {r: checkpoint.load_rank_file(ckpt, r) for r in range(meta["world"])}
    _check_replicas(ckpt, rank_files)
    return cfg, ckpt, meta, rank_files


def _assemble(run, ckpt, stream_prefix, max_rows_in_memory):
    cfg, ckpt, meta, rank_files = _open_checkpoint(run, ckpt)
    out: Dict[str, torch.Tensor] = {}
    files = []
    for name, parts in _tables(meta["placement"]).items():
        parts = [(st, dict(pm, init_scale=cfg.embedding.init_scale)) for st, pm in parts]
        vocab = parts[0][1]["vocab"]
        big = vocab > max_rows_in_memory
        if big and stream_prefix is None:
            raise ValueError(f"table {name}: {vocab} rows exceed max_rows_in_memory; export to a file to stream")
        block = 1_000_000 if big else max(vocab, 1)
        for bi, (start, w, s) in enumerate(_table_blocks(ckpt, parts, meta["seed"], rank_files, block)):
            if big:
                path = f"{stream_prefix}.{name}.{bi:05d}.pt"
                torch.save({f"embedding.{name}.weight": w, f"embedding.{name}.adagrad_state": s,
                            f"embedding.{name}.first_id": torch.tensor(start)}, path)
                files.append(path)
            else:
                out[f"embedding.{name}.weight"] = w
                out[f"embedding.{name}.adagrad_state"] = s
    out.update(_replicated_and_dense(run, cfg, meta, rank_files[0]))
    return out, files


def _replicated_and_dense(run, cfg, meta, r0) -> Dict[str, torch.Tensor]:
    """Everything but the sharded tables: replicated tables, dense parameters, AdamW state, ``meta.step``."""
    out: Dict[str, torch.Tensor] = {}
    for name, rep in r0["replicated"].items():
        out[f"embedding.{name}.weight"] = rep["weight"]
        out[f"embedding.{name}.adagrad_state"] = rep["state"]
    for k in sorted(r0["dense"]):
        out[f"dense.{k}"] = r0["dense"][k]
    # AdamW state: optimizer params are in model.parameters() order
    manifest, _ = run_manifest(run, cfg)  # what export needs of the shards: the run's manifest copy
    model = build_model(cfg, manifest, model_table_dims(cfg, manifest))
    pnames = [n for n, _ in model.named_parameters()]
    for idx, st in r0["optimizer"]["state"].items():
        for k, v in st.items():
            out[f"optim.dense.{pnames[int(idx)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    out["meta.step"] = torch.tensor(meta["step"])
    return out


def export_run(run: str, out_file: str, max_rows_in_memory: int = 50_000_000) -> Dict:
    """Write the export to ``out_file``: safetensors when it ends in ``.safetensors`` (:func:`export_safetensors`),
    else ``torch.save``."""
    if out_file.endswith(SAFETENSORS_SUFFIX):
        return export_safetensors(run, out_file)
    prefix = out_file[:-3] if out_file.endswith(".pt") else out_file
    tensors, files = _assemble(run, None, prefix, max_rows_in_memory)
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    tmp = out_file + ".tmp"
    torch.save(tensors, tmp)
    os.replace(tmp, out_file)
    return {"file": out_file, "tensors": len(tensors), "streamed_files": files, "step": int(tensors["meta.step"])}


# -- safetensors ------------------------------------------------------------------------------------------------------
SAFETENSORS_SUFFIX = ".safetensors"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def export_safetensors(run: str, out_file: str, block_rows: int = 1_000_000) -> Dict:
    """The export as one safetensors file (the same names and tensors as the ``torch.save`` export), streamed: each
    sharded table is assembled and written ``block_rows`` ids at a time, so memory holds one block (plus the
    table's AdaGrad state, ``1 / dim`` of it) however large the table. Beside it, ``FILE.config.json``: the run's
    configuration, its tables (vocabulary, width) and the step, what a reader needs to rebuild the model.

    The file is written here rather than by the ``safetensors`` package, whose writers take every tensor in memory
    at once; the format (8-byte little-endian header length, a JSON header of dtype, shape and byte offsets per
    tensor, the raw little-endian bytes) is read back with ``safetensors`` in the tests. Atomic: a temporary file
    renamed over ``out_file``."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian bytes; this host is big-endian")
    cfg, ckpt, meta, rank_files = _open_checkpoint(run)
    entries = _safetensors_entries(run, cfg, ckpt, meta, rank_files, block_rows)
    header, offset = {}, 0
    for key, dtype, shape, _ in entries:
        if dtype not in _ST_DTYPES:
            raise TypeError(f"{key}: dtype {dtype} has no safetensors name")
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt", "producer": "nestpipe export", "model": cfg.model,
                              "step": str(meta["step"])}
    _write_safetensors(out_file, header, entries)
    manifest, _ = run_manifest(run, cfg)
    config_file = out_file[: -len(SAFETENSORS_SUFFIX)] + ".config.json"
    write_json_atomic(config_file, {
        "model": cfg.model, "step": int(meta["step"]), "config": cfg.to_dict(),
        "tables": {t: {"vocab": spec.vocab, "dim": spec.dim, "kind": spec.kind} for t, spec in manifest.tables.items()},
        "tensors": len(entries)})
    return {"file": out_file, "config": config_file, "tensors": len(entries), "streamed_files": [],
            "step": int(meta["step"])}


def _safetensors_entries(run: str, cfg, ckpt, meta, rank_files, block_rows: int) -> list:
    """(name, dtype, shape, chunks) of every exported tensor, in file order; ``chunks()`` yields the tensor's rows in
    order (a sharded table's weight block by block, then its AdaGrad state blocks kept meanwhile)."""
    entries = []
    for name, parts in _tables(meta["placement"]).items():
        parts = [(st, dict(pm, init_scale=cfg.embedding.init_scale)) for st, pm in parts]
        dtype = table_dtype(rank_files[0]["tables"][parts[0][0]])
        vocab, dim = parts[0][1]["vocab"], sum(pm["dim"] for _, pm in parts)
        states: list = []  # the state blocks, kept while the weight blocks are written (the weight comes first)

        def weights(parts=parts, states=states):
            for _, w, st in _table_blocks(ckpt, parts, meta["seed"], rank_files, max(1, block_rows)):
                states.append(st)
                yield w

        def adagrad(states=states):
            while states:
                yield states.pop(0)

        entries.append((f"embedding.{name}.weight", dtype, [vocab, dim], weights))
        entries.append((f"embedding.{name}.adagrad_state", dtype, [vocab] + ([len(parts)] if len(parts) > 1 else []),
                        adagrad))
    for key, t in sorted(_replicated_and_dense(run, cfg, meta, rank_files[0]).items()):
        entries.append((key, t.dtype, list(t.shape), lambda t=t: iter([t])))
    return entries


def _write_safetensors(out_file: str, header: Dict, entries: list) -> None:
    """The header and every entry's bytes in order, to a temporary file renamed over ``out_file`` (atomic)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = out_file + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for key, dtype, shape, chunks in entries:
                written = 0
                for t in chunks():
                    b = t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(b.tobytes())
                    written += b.nbytes
                lo, hi = header[key]["data_offsets"]
                if written != hi - lo:
                    raise RuntimeError(f"{key}: wrote {written} bytes, the header says {hi - lo}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
