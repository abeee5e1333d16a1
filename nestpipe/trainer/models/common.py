"""Shared model helpers: explicit, generator-driven parameter initialisation (the global RNG is never used)."""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from nestpipe.trainer.embedding.batch import NEG_SLOT as NEG  # the slot of the batch's shared negatives
from nestpipe.trainer.embedding.config import row_shape
from nestpipe.utils.options import opt


@torch.no_grad()
def init_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise every parameter in name order from ``generator``: Linear weights U(-1/sqrt(fan_in), ..),
    biases 0, LayerNorm 1/0, other tensors N(0, 0.02)."""
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if isinstance(owner, nn.LayerNorm):
            p.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            p.zero_()
        elif p.dim() == 2 and isinstance(owner, nn.Linear):
            bound = 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float64).mul_(2 * bound).sub_(bound))
        else:
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64).mul_(0.02))


def mlp(sizes, final_activation: bool = True) -> nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if final_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# -- sequential next-item models (hstu, sasrec): shared inputs and objective -------------------------------------
OUTPUT_EMBEDDINGS = ("untied", "tied")
OUTPUT_EMBEDDING_HELP = (
    "untied: every item row holds an input embedding (its token) and an output embedding (the candidate scored "
    "against the query), so an item need not resemble the items it follows; tied: one embedding for both "
    "(the item table is half as wide)")


# The sequential models' defaults for shared keys: the item table learns at 3x the other tables' rate. Chosen on the
# valid split of the demo's data (three seeds) and of the medium data (seed 0), docs/trainer.md (the item table's rate):
# the item rows carry which video follows which, the pairs a next-item model must memorise from a few occurrences.
SEQUENTIAL_TRAIN_DEFAULTS = {"embedding": {"table_lr": {"item": 0.15}}}


TRANSITION_HELP = (
    "weight of the first-order transition term (FPMC, Rendle et al. 2010): every item row gains a 'from' and a 'to' "
    "block, and a candidate's score adds this weight x cos(from(last item), to(candidate)), so which item follows "
    "which is learned in its own factors beside the sequence encoder's query; 0: off (docs/trainer.md)")


ITEM_BIAS_HELP = (
    "scale s of a learned per-item logit offset: every item row gains a few columns whose first value a adds "
    "s x a to the item's logit as a candidate (unbounded, beside the cosines), so an item's popularity need not be "
    "written into its direction; 0: off (docs/trainer.md)")

# The item bias's columns at the end of an item row: the offset and three unused columns, so that row widths stay
# multiples of 4 (the row alignment fbgemm's table-batched embedding kernels require).
ITEM_BIAS_COLUMNS = 4


def _item_blocks(section) -> int:
    return (2 if section.output_embedding == "untied" else 1) + (2 if section.transition else 0)


def sequential_table_widths(section) -> Dict[str, object]:
    """Item rows are ``[input | output | from | to | bias]``, the output block with ``untied`` output embeddings,
    the transition blocks with a ``transition`` weight (each block one embedding dim wide), the bias columns
    (``ITEM_BIAS_COLUMNS``) with an ``item_bias`` scale; other sequence tables one embedding dim."""
    blocks = _item_blocks(section)
    if section.item_bias:
        return {"item": (blocks, ITEM_BIAS_COLUMNS)}
    return {"item": blocks} if blocks > 1 else {}


def sequential_token_dim(name: str, section, sequence_tables: List[str], dims: Dict[str, int]) -> int:
    """The token dim D of a sequential model: every sequence table's rows are D wide, the item table's
    ``blocks x D`` (plus the item bias's columns)."""
    shapes = {t: row_shape(w) for t, w in sequential_table_widths(section).items()}
    blocks = {t: shapes.get(t, (1, 0))[0] for t in sequence_tables}
    inner = {t: dims[t] - shapes.get(t, (1, 0))[1] for t in sequence_tables}
    dset = {inner[t] // blocks[t] for t in sequence_tables}
    if len(dset) != 1 or any(inner[t] % blocks[t] for t in sequence_tables):
        raise ValueError(f"{name} needs one embedding dim for all sequence tables (the item table {blocks['item']}"
                         f" times as wide with output_embedding={section.output_embedding!r}), got {dims}")
    return dset.pop()


class SequentialModel(nn.Module):
    """What hstu and sasrec share: token inputs (``tables`` summed + a learned position ``pos``), a final LayerNorm
    and the next-item objective; a subclass adds its layers and ``encode``. ``cfg`` holds ``num_random_negatives``,
    ``temperature``, ``history_negatives``, ``logq_correction`` and ``output_embedding``; ``num_items`` is the
    catalog size V.

    With ``output_embedding == "untied"`` an item's row is ``[input | output]`` (``2 D`` wide): the token uses the
    input half, the candidate side of the objective (the target, the shared negatives, the history negatives) and
    of evaluation the output half. Both halves share the row's optimizer state (one row, one row-wise AdaGrad
    accumulator).

    With a ``transition`` weight ``w`` the row also holds ``from`` and ``to`` blocks (FPMC's first-order factors):
    the query of a position is ``[unit(hidden) | sqrt(w) unit(from(its own item))]`` (:meth:`queries`), a candidate
    ``[unit(output) | sqrt(w) unit(to(item))]`` (:meth:`candidates`), and the logit ``(cos(hidden, output) +
    w cos(from, to)) / temperature``: one dot product, as without the term, in training, evaluation and serving
    alike. The objective normalises both sides again (dividing the dot product by ``1 + w``), which
    :attr:`score_temperature`, ``temperature / (1 + w)``, undoes: the encoder's cosine keeps the configured
    temperature and the term adds up to ``w / temperature`` on top."""

    def __init__(self, name: str, cfg, dim: int, sequence_tables: List[str], max_seq_len: int, num_items: int = 0):
        super().__init__()
        self.cfg = cfg
        self.dim = dim
        self.num_items = num_items  # the item catalog size V (the logQ correction's log(V / K))
        self.tables = sorted(sequence_tables)
        if "item" not in self.tables:
            raise ValueError(f"{name} needs a sequence table named 'item' (got {self.tables})")
        self.max_len = max_seq_len
        self.pos = nn.Parameter(torch.zeros(max_seq_len, dim))
        self.norm_out = nn.LayerNorm(dim)

        self.untied = cfg.output_embedding == "untied"
        self.transition = float(cfg.transition)
        self.item_bias = float(cfg.item_bias)

    def encode(self, emb: Dict[str, torch.Tensor], lengths: torch.Tensor,
               times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token embeddings (``token_inputs``) -> hidden states. ``times``: the tokens' event times in ms (int64),
        for models whose ``needs_times``."""
        raise NotImplementedError

    @property
    def needs_times(self) -> bool:
        """Whether :meth:`encode` reads the tokens' event times."""
        return False

    def token_inputs(self, emb: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The sequence tables' rows as token inputs (the input block of item rows wider than one dim)."""
        if not (self.untied or self.transition or self.item_bias):
            return emb
        return {t: (e[:, :self.dim] if t == "item" else e) for t, e in emb.items() if t != NEG}

    @property
    def score_temperature(self) -> float:
        """The temperature of the objective's cosine of unit query and candidate vectors (``temperature``, divided
        by ``1 + w`` with the transition term: see the class docstring)."""
        return self.cfg.temperature / (1.0 + self.transition)

    def _block(self, item_rows: torch.Tensor, k: int) -> torch.Tensor:
        return item_rows[:, k * self.dim:(k + 1) * self.dim]

    def candidates(self, item_rows: torch.Tensor) -> torch.Tensor:
        """Item rows as candidates of the objective and of evaluation (the output block of untied rows; with the
        transition term, the unit output block and the weighted unit ``to`` block side by side)."""
        out = self._block(item_rows, 1 if self.untied else 0)
        if not self.transition:
            return out
        to = self._block(item_rows, 3 if self.untied else 2)
        return torch.cat([F.normalize(out, dim=-1), math.sqrt(self.transition) * F.normalize(to, dim=-1)], dim=1)

    def candidate_bias(self, item_rows: torch.Tensor) -> Optional[torch.Tensor]:
        """``[N]``: the items' logit offsets ``s x a`` (``a`` the first of the row's bias columns), added to the
        scaled cosine in training, evaluation and serving; None without ``item_bias``."""
        if not self.item_bias:
            return None
        return self.item_bias * item_rows[:, _item_blocks(self.cfg) * self.dim]

    def queries(self, hidden: torch.Tensor, item_rows: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, D]`` -> the queries scored against :meth:`candidates`; ``item_rows``: the item rows
        of the same tokens (each position's own item: the transition term's ``from`` block)."""
        if not self.transition:
            return hidden
        frm = self._block(item_rows, 2 if self.untied else 1)
        return torch.cat([F.normalize(hidden, dim=-1), math.sqrt(self.transition) * F.normalize(frm, dim=-1)], dim=1)

    def forward(self, emb: Dict[str, torch.Tensor], feats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss ``[b]``: mean next-item sampled-softmax loss over the sample's positions."""
        k = self.cfg.num_random_negatives
        w = math.log(self.num_items / k) if self.cfg.logq_correction and k and self.num_items > k else 0.0
        hidden = self.queries(self.encode(self.token_inputs(emb), feats["lengths"], feats.get("times")), emb["item"])
        out = {"item": self.candidates(emb["item"]), NEG: self.candidates(emb[NEG])}
        bias = None if not self.item_bias else {"item": self.candidate_bias(emb["item"]),
                                                NEG: self.candidate_bias(emb[NEG])}
        return next_item_loss(hidden, out, feats, self.score_temperature, self.cfg.history_negatives, w,
                              in_batch=self.cfg.in_batch_negatives, logit_dtype=NEGATIVE_DTYPES[self.cfg.negatives_dtype],
                              bias=bias)


NEGATIVE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
IN_BATCH_HELP = (
    "up to this many of the micro-batch's own targets (every ceil(Q / N)-th of its Q positions, a sample of the "
    "items in proportion to their frequency) join every position's negatives through one GEMM, the position's own "
    "target masked, each logit corrected by -log(N_used x count / Q) (the expected number of copies among them); "
    "0: off")
NEGATIVES_DTYPE_HELP = ("dtype of the query x negative logits (the shared and in-batch GEMMs; the softmax sums in "
                        "float32): bfloat16 halves their bytes")


@dataclasses.dataclass
class NextItemObjective:
    """The next-item objective of every sequential model (hstu, sasrec; their configs extend this one): a sampled
    softmax over shared uniform, in-batch, popular and history negatives, the output embeddings, the transition term
    and the item bias. The same defaults for both models, so that they differ in the encoder only."""

    num_random_negatives: int = opt(
        4096, help="uniform random negatives, shared by the batch (more cost time and help full-catalog ranking: "
        "docs/trainer.md)", minimum=0)
    num_popular_negatives: int = opt(
        0, help="in-batch popularity negatives (they push popular items down, which costs full-catalog HR/NDCG "
        "without a logQ correction: off by default)", minimum=0)
    temperature: float = opt(0.1, help="softmax temperature of the sampled softmax", minimum=0)
    history_negatives: bool = opt(
        False, help="each position's own prefix items (other than its target) join its negatives; off by default "
        "since the item bias (docs/trainer.md)")
    logq_correction: bool = opt(
        True, help="weigh each uniform negative as V / K catalog items (log(V / K) added to its logit)")
    output_embedding: str = opt("untied", help=OUTPUT_EMBEDDING_HELP, choices=OUTPUT_EMBEDDINGS)
    in_batch_negatives: int = opt(1024, help=IN_BATCH_HELP, minimum=0)
    transition: float = opt(0.3, help=TRANSITION_HELP, minimum=0)
    item_bias: float = opt(0.5, help=ITEM_BIAS_HELP, minimum=0)
    negatives_dtype: str = opt("float32", help=NEGATIVES_DTYPE_HELP, choices=tuple(NEGATIVE_DTYPES))


def jagged_positions(lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Of every token of a jagged micro-batch (samples of ``lengths`` in order): ``(sample, position in it, index
    in the padded [b, n] layout, n)``, ``n`` the longest sample."""
    b = len(lengths)
    n = int(lengths.max()) if b else 0
    sample = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(len(sample), device=lengths.device) - starts[sample]
    return sample, pos, sample * n + pos, n


def jagged_tokens(emb: Dict[str, torch.Tensor], tables: List[str], pos_table: torch.Tensor, lengths: torch.Tensor,
                  max_len: int) -> torch.Tensor:
    """Token inputs ``[nnz, D]`` in sample order: the sum over ``tables`` plus the learned position of each token in
    its sample."""
    _, pos, _, _ = jagged_positions(lengths)
    return _token_sum(emb, tables, pos_table, pos, max_len)


def _token_sum(emb: Dict[str, torch.Tensor], tables: List[str], pos_table: torch.Tensor, pos: torch.Tensor,
               max_len: int) -> torch.Tensor:
    x = emb[tables[0]]
    for t in tables[1:]:
        x = x + emb[t]
    return x + pos_table.index_select(0, pos.clamp(max=max_len - 1))


def padded_tokens(emb: Dict[str, torch.Tensor], tables: List[str], pos_table: torch.Tensor, lengths: torch.Tensor,
                  max_len: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jagged token embeddings (sum over ``tables`` + the learned position of each token in its sample) ->
    ``(padded [b, n, D], flat index of every token in padded.view(b * n, D), valid [b, n])``, ``n`` the longest
    sample of the micro-batch."""
    b = len(lengths)
    _, pos, flat, n = jagged_positions(lengths)
    x = _token_sum(emb, tables, pos_table, pos, max_len)
    padded = x.new_zeros(b * n, x.shape[1]).index_copy(0, flat, x).view(b, n, x.shape[1])
    valid = torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]
    return padded, flat, valid


def next_item_loss(hidden: torch.Tensor, emb: Dict[str, torch.Tensor], feats: Dict[str, torch.Tensor],
                   temperature: float, history_negatives: bool = False,
                   sampled_log_weight: float = 0.0, in_batch: int = 0,
                   logit_dtype: torch.dtype = None,
                   bias: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    """Per-sample loss ``[b]``: the mean over the sample's positions of the next-item sampled softmax (cosine
    similarity of the query and the candidate embeddings ``emb["item"]`` / ``emb[NEG]`` / ``temperature``; the
    target against the batch's shared negatives, negatives equal to the target masked). A per-sample mean, so the
    loss does not depend on how the batch is partitioned into micro-batches.

    ``history_negatives``: each position's own prefix (the distinct items the sample read up to and including the
    position, other than the target) joins its negatives. Uniform negatives almost never contain a user's own
    items, so without them nothing teaches the model that the next item is usually not one it just read, and the
    query, built from those items, scores them high. ``sampled_log_weight``: added to every uniform negative's logit;
    ``log(V / K)`` makes each of the K uniform draws stand for V / K catalog items (the sampled-softmax logQ
    correction), so that the prefix items, present once each, weigh what they weigh in the full softmax.

    ``in_batch``: up to this many of the micro-batch's targets serve as further negatives of every position
    (:func:`_in_batch_negatives`: a frequency-proportional sample, the logQ-corrected logit of each, the position's
    own target masked). ``logit_dtype`` (e.g. bfloat16): the query x negative GEMMs in that dtype. ``bias``: the
    candidates' learned logit offsets (``item_bias``: ``{"item": [tokens], NEG: [K]}``), added to the target's logit
    and to every negative's, the in-batch and history negatives' included."""
    lengths = feats["lengths"]
    b = len(lengths)
    sample = torch.repeat_interleave(torch.arange(b, device=lengths.device), lengths)
    ends = torch.cumsum(lengths, 0) - 1
    is_query = torch.ones(len(sample), dtype=torch.bool, device=lengths.device)
    is_query[ends] = False
    q_idx = torch.nonzero(is_query).flatten()
    query = F.normalize(hidden.index_select(0, q_idx), dim=-1)
    target = F.normalize(emb["item"].index_select(0, q_idx + 1), dim=-1)
    negs = F.normalize(emb[NEG], dim=-1)
    pos_logit = (query * target).sum(-1, keepdim=True) / temperature
    q_rows, n_cols = _collisions(feats["item_ids"].index_select(0, q_idx + 1), feats["neg_ids"])
    q_scaled = query / temperature
    token_bias = t_bias = None
    neg_weight = float(sampled_log_weight)
    if bias is not None:  # the candidates' offsets: per-column weights of the negatives' logsumexps (with gradient)
        token_bias = bias["item"]
        t_bias = token_bias.index_select(0, q_idx + 1)
        pos_logit = pos_logit + t_bias[:, None]
        neg_weight = bias[NEG] + neg_weight
    neg_lse = SharedNegativesLSE.apply(q_scaled, negs, neg_weight, q_rows, n_cols, logit_dtype)
    logits = [pos_logit, neg_lse[:, None]]
    if in_batch:
        logits.append(_in_batch_lse(q_scaled, target, feats["item_ids"].index_select(0, q_idx + 1), in_batch,
                                    logit_dtype, t_bias)[:, None])
    if history_negatives:
        logits.append(_history_lse(query, emb["item"], feats["item_ids"], lengths, q_idx, temperature,
                                   token_bias)[:, None])
    logits = torch.cat(logits, dim=1)
    token_loss = torch.logsumexp(logits, dim=1) - logits[:, 0]
    q_sample = sample.index_select(0, q_idx)
    per_sample = token_loss.new_zeros(b).index_add(0, q_sample, token_loss)
    count = torch.zeros(b, dtype=token_loss.dtype, device=lengths.device).index_add(
        0, q_sample, torch.ones_like(token_loss))
    return per_sample / count.clamp(min=1)


def _collisions(targets: torch.Tensor, neg_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(query row, negative column) of every shared negative equal to the query's target (masked out of its
    softmax), found through the sorted negative ids instead of a ``[Q, K]`` comparison."""
    order = torch.argsort(neg_ids, stable=True)
    ids = neg_ids.index_select(0, order)
    lo = torch.searchsorted(ids, targets, right=False)
    hi = torch.searchsorted(ids, targets, right=True)
    counts = hi - lo
    rows = torch.repeat_interleave(torch.arange(len(targets), device=targets.device), counts)
    first = torch.repeat_interleave(lo, counts)
    within = torch.arange(len(rows), device=targets.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts)
    return rows, order.index_select(0, first + within)


def _in_batch_lse(q_scaled: torch.Tensor, targets: torch.Tensor, target_ids: torch.Tensor, limit: int,
                  logit_dtype: torch.dtype = None, target_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[Q]``: per query, the logsumexp over the in-batch negatives of ``q . t_j - log(N x c_j / Q)``, the query's
    own target item left out.

    The negatives are ``N = min(limit, Q)`` of the micro-batch's ``Q`` target rows, taken at evenly spaced positions
    (a deterministic systematic sample: the same in every schedule, and an item appears about in proportion to its
    frequency ``c_j / Q`` among the targets). The expected number of copies of item ``j`` among them is
    ``N c_j / Q``; subtracting its log (the logQ correction) makes the copies stand for one catalog item each, as the
    uniform negatives' ``log(V / K)`` does. Without it the frequent items, drawn many times, would be pushed down
    in proportion to their popularity. Gradients reach the sampled target rows as well as the queries."""
    n_q = len(target_ids)
    if n_q == 0:
        return q_scaled.new_zeros(0)
    n = min(int(limit), n_q)
    pick = (torch.arange(n, device=target_ids.device) * n_q) // n  # evenly spaced positions, the first included
    ids = target_ids.index_select(0, pick)
    _, inv, counts = torch.unique(target_ids, return_inverse=True, return_counts=True)
    freq = counts.index_select(0, inv.index_select(0, pick)).to(q_scaled.dtype)  # c_j of every sampled row
    weight = -torch.log(freq * (n / n_q))
    if target_bias is not None:  # the sampled targets' offsets (item_bias), beside the correction
        weight = weight + target_bias.index_select(0, pick)
    rows, cols = _collisions(target_ids, ids)
    return SharedNegativesLSE.apply(q_scaled, targets.index_select(0, pick), weight, rows, cols, logit_dtype)


class SharedNegativesLSE(torch.autograd.Function):
    """``logsumexp_j(q_i . n_j + w_j)`` per query row over the batch's shared negatives, the pairs ``(rows, cols)``
    left out; ``w`` one number for every column or one per column (``[K]``); one ``[Q, K]`` buffer, exponentiated
    in place and kept for the backward. ``logit_dtype`` (bfloat16): the two GEMMs of the forward and the backward
    take their operands in that dtype; the buffer, the sums and the gradients stay in the inputs' dtype. A ``[K]``
    ``w`` that requires grad (learned offsets) gets the column sums of ``softmax * g``.

    Written by hand because the composed ops (matmul, add, masked fill, max, subtract, exp, sum, and their backward)
    stream the ``[Q, K]`` logits through memory a dozen times; this takes five passes and two matmuls, the gradient
    being ``softmax * g`` on the rows. Deterministic (no atomics), the same on every device and in every schedule."""

    @staticmethod
    def forward(ctx, q, negs, log_weight, rows, cols, logit_dtype=None):
        ctx.logit_dtype = logit_dtype
        if logit_dtype is None:
            scores = q @ negs.t()
        else:
            scores = (q.to(logit_dtype) @ negs.to(logit_dtype).t()).to(q.dtype)
        if torch.is_tensor(log_weight):
            scores.add_(log_weight[None, :])
        elif log_weight:
            scores.add_(log_weight)
        if len(rows):
            scores.index_put_((rows, cols), scores.new_tensor(float("-inf")))
        peak = scores.amax(1, keepdim=True)
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a row with every negative masked
        scores.sub_(peak).exp_()
        total = scores.sum(1, keepdim=True)
        ctx.save_for_backward(scores, total, q, negs)
        return (peak + total.log()).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        probs, total, q, negs = ctx.saved_tensors
        g = probs * (grad[:, None] / total.clamp(min=torch.finfo(total.dtype).tiny))  # 0, not nan, on empty rows
        low = ctx.logit_dtype
        if low is not None:
            g16, q, negs = g.to(low), q.to(low), negs.to(low)
            grad_q = (g16 @ negs).to(g.dtype) if ctx.needs_input_grad[0] else None
            grad_negs = (g16.t() @ q).to(g.dtype) if ctx.needs_input_grad[1] else None
        else:
            grad_q = g @ negs if ctx.needs_input_grad[0] else None
            grad_negs = g.t() @ q if ctx.needs_input_grad[1] else None
        grad_w = g.sum(0) if ctx.needs_input_grad[2] else None
        return grad_q, grad_negs, grad_w, None, None, None


def _history_lse(query: torch.Tensor, items: torch.Tensor, item_ids: torch.Tensor, lengths: torch.Tensor,
                 q_idx: torch.Tensor, temperature: float, token_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[Q]``: per query, the logsumexp of the history logits :func:`_history_logits` keeps (-1e9 entries where it
    keeps none, so the term vanishes from the token's softmax). Computed per bucket of samples whose lengths share a
    power-of-two ceiling, each padded to its own longest: a micro-batch pays about its own ``sum(L^2)``, not
    ``b x longest^2`` (a long sample among short ones no longer pads every sample to its length)."""
    dev = lengths.device
    normed = F.normalize(items, dim=-1)
    starts = torch.cumsum(lengths, 0) - lengths
    row_of = torch.full((len(items),), -1, dtype=torch.long, device=dev)  # token -> its query row
    row_of[q_idx] = torch.arange(len(q_idx), device=dev)
    lens = lengths.tolist()
    buckets: Dict[int, List[int]] = {}
    for s, n in enumerate(lens):
        if n >= 2:
            buckets.setdefault(1 << (n - 1).bit_length(), []).append(s)
    out = query.new_full((len(q_idx),), -1e9)
    for _, members in sorted(buckets.items()):
        s = torch.tensor(members, dtype=torch.long, device=dev)
        n = max(lens[m] for m in members)
        j = torch.arange(n, device=dev)
        ls = lengths.index_select(0, s)[:, None]
        valid = j[None, :] < ls  # [B, n]: positions inside the sample
        tok = torch.where(valid, starts.index_select(0, s)[:, None] + j[None, :], torch.zeros_like(valid, dtype=torch.long))
        ids = item_ids[tok].masked_fill(~valid, -1)
        is_q = j[None, :] < ls - 1  # the sample's queries: every position but its last
        q_row = row_of[tok].clamp(min=0)
        logit = (query[q_row] * is_q[..., None]) @ (normed[tok] * valid[..., None]).transpose(1, 2) / temperature
        if token_bias is not None:
            logit = logit + token_bias[tok][:, None, :]
        earlier = torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev), diagonal=-1)
        first = ~((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)  # no earlier position has the item
        target = torch.cat([ids[:, 1:], ids.new_full((len(members), 1), -2)], dim=1)  # query p's target: item p+1
        keep = ((j[None, None, :] <= j[None, :, None]) & (first & valid)[:, None, :]
                & (ids[:, None, :] != target[:, :, None]))
        lse = logit.masked_fill(~keep, -1e9).logsumexp(-1)  # [B, n]
        out = out.index_copy(0, q_row[is_q], lse[is_q])
    return out


def _history_logits(query: torch.Tensor, items: torch.Tensor, item_ids: torch.Tensor, lengths: torch.Tensor,
                    q_idx: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[Q, n]`` logits of every query against its sample's items at positions up to its own, masked (-1e9) where
    the item is the query's target or repeats an earlier position of the sample. The definition of the history
    negatives, on the micro-batch padded to its longest sample: the reference :func:`_history_lse` is tested
    against (the objective uses that one)."""
    b = len(lengths)
    sample, pos, flat, n = jagged_positions(lengths)
    d = items.shape[1]
    items_pad = items.new_zeros(b * n, d).index_copy(0, flat, F.normalize(items, dim=-1)).view(b, n, d)
    q_pad = query.new_zeros(b * n, d).index_copy(0, flat.index_select(0, q_idx), query).view(b, n, d)
    q_flat = flat.index_select(0, q_idx)
    logit = (q_pad @ items_pad.transpose(1, 2)).view(b * n, n).index_select(0, q_flat) / temperature
    ids = torch.full((b * n,), -1, dtype=item_ids.dtype, device=item_ids.device).index_copy(0, flat, item_ids)
    ids = ids.view(b, n)
    earlier = torch.tril(torch.ones(n, n, dtype=torch.bool, device=ids.device), diagonal=-1)
    first = ~((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)  # [b, n]: no earlier position has the item
    qs, qp = sample.index_select(0, q_idx), pos.index_select(0, q_idx)
    keep = (torch.arange(n, device=ids.device)[None, :] <= qp[:, None]) & first.index_select(0, qs)
    keep &= ids.index_select(0, qs) != item_ids.index_select(0, q_idx + 1)[:, None]
    return logit.masked_fill(~keep, -1e9)
