"""Drafting for B rows at once: EAGLE-1 static trees and EAGLE-2 dynamic trees as tensors.

The batched counterpart of `draft.Drafter`, growing the same trees (same head, same top-k, same
EAGLE-2 rerank) but for every row in one head forward per depth, with nothing read back to the
host. Shapes depend only on (B, N, view_len), so a call can be captured in a CUDA graph.

Draft cache (a RowKVCache, as in Drafter): slot t of a row holds the pair (x[t+1], f[t]) at
position t. Its committed slots are 0..lengths[b]-1; the newest of them is the root pair, and the
head's output there (root_hidden) predicts the depth-1 tokens. A tree node at depth d sits at
position lengths[b] - 1 + d. Drafting writes the nodes it runs through the head into scratch
slots lengths[b] + s (s < `scratch`) and leaves `lengths` alone: the next `commit` overwrites them
with the accepted tokens and the target's real features, which is what the head was trained on.
A node attends to the committed slots, the scratch slots of its drafted ancestors and its own.

Scratch layout: EAGLE-2 puts the K frontier nodes of depth d at s = (d - 1) * K + j; EAGLE-1 puts
the layout's inner (non-leaf, non-root) nodes one after another, depth by depth.

Drafts are the head's top-k tokens, which verification treats as q(x) = 1 (EAGLE-2). The
exception is an EAGLE-2 tree for sampled rows. A chain (top-k 1) has a shape that does not depend
on the drafted values, so its tokens are drawn from the head's distribution q and kept in
`draft_probs` for the p/q rule, which accepts sum(min(p, q)) at each depth instead of p(top-1
token). A wider one (top-k > 1) is replaced by a fixed shape of the same size (tree.sampled_layout)
whose siblings are drawn from q without replacement, which the same p/q rounds verify exactly
(EAGLE-2's rerank would make the shape depend on the drawn values, and the draws biased). An
EAGLE-1 layout is fixed already: sampled rows draw its siblings the same way when its ranks are
0..m-1 under every node (tree.siblings_in_rank_order; the default layout's are).

On a CPU with int8 drafting of a one-layer EAGLE-1/2 head, `commit`, `propose` (EAGLE-1 and
EAGLE-2) and the sampled chains and trees of temperature-only rows each run as one call of
csrc/draft_runner.cpp (the same kernels in the same order, so the same bits; `native_runner`,
`NATIVE`); the torch ops below stay the path everywhere else and the reference its tests compare
against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import attention, direct
from ..config import TreeConfig
from ..draft import DraftHead, Head
from ..kernels import ops_kernel
from ..kv_cache import RowKVCache, row_attention_mask
from ..model import Transformer
from ..tree import StaticLayout, sampled_layout, siblings_in_rank_order, static_layout
from .draft_quant import int8_head, int8_linear
from .rng import DRAFT, draw, uniforms
from .sampling import RowSampling, row_probabilities
from .tree import BatchTree, ancestors_from_parents


@dataclass
class _Level:
    """One depth d >= 1 of an EAGLE-1 layout (L nodes, R of them with children), as index tensors."""

    src: torch.Tensor  # [L] each node's token: index into the parent level's top table [R', W'] flattened
    run: torch.Tensor  # [R] nodes (index within this level) that go through the head: those with children
    hid: torch.Tensor  # [R] their parents' index within the previous run list (the root's list is [root])
    anc: torch.Tensor  # [R, S] bool: scratch slots of their drafted ancestors and their own
    first: int  # their scratch slots are first + 0..R-1
    width: int  # top-k width their children need (highest child rank + 1)
    start: int  # node id of the level's first node (a level's nodes are consecutive)


@dataclass
class _Frame:
    """What every head forward of one `propose` shares: the rows' committed lengths, the scratch
    slots, and the parts of `row_attention_mask` that do not depend on the nodes (the scratch
    block starts at each row's committed length at every depth)."""

    committed: torch.Tensor  # [B]
    slots: torch.Tensor  # [B, S] scratch slot s of each row
    visible: torch.Tensor  # [B, 1, V] committed slots: seen by every node
    in_block: torch.Tensor  # [B, 1, V] slots inside the scratch block
    offset: torch.Tensor  # [B, 1, V] a slot's index into the block (clamped)

    @classmethod
    def of(cls, committed: torch.Tensor, scratch: int, view_len: int) -> "_Frame":
        cols = torch.arange(view_len, device=committed.device)[None]  # [1, V]
        rel = cols - committed[:, None]  # [B, V]
        width = max(scratch, 1)
        return cls(committed, committed[:, None] + torch.arange(scratch, device=committed.device),
                   (cols < committed[:, None])[:, None], ((rel >= 0) & (rel < width))[:, None],
                   rel.clamp(0, width - 1)[:, None])

    def mask(self, anc: torch.Tensor) -> torch.Tensor:
        """row_attention_mask(committed, committed, anc, view_len): anc [B, T, S] -> [B, T, V]."""
        b, t, _ = anc.shape
        return self.visible | (self.in_block & torch.gather(anc, 2, self.offset.expand(b, t, -1)))


@dataclass
class _StaticPlan:
    """A fixed tree shape (an EAGLE-1 layout, or tree.sampled_layout's) as the index tensors its
    drafting runs on: the nodes of each depth that go through the head, their scratch slots, and
    where each node's token sits in its parent level's table of children."""

    levels: list[_Level]
    root_width: int  # children the root needs (highest child rank + 1)
    scratch: int  # scratch slots: one per non-root node with children
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # parents [1, N], depth [1, N], ancestors [1, N, N]
    budget: int
    max_depth: int
    max_children: int
    native_args: tuple  # the layout as csrc/draft_runner.cpp's propose_static takes it
    widest: int  # the most nodes of one head forward

    @classmethod
    def of(cls, layout: StaticLayout, dev: torch.device, scratch: int = 0) -> "_StaticPlan":
        """scratch: the width of the draft's scratch block when it is wider than this layout needs
        (the proposer's other tree shares the block)."""
        par, n = layout.parents, len(layout.parents)
        max_children = max(sum(1 for p in par if p == i) for i in range(n))
        need = [0] * n  # top candidates each node must supply = highest child rank + 1
        for i in range(1, n):
            need[par[i]] = max(need[par[i]], layout.ranks[i] + 1)
        runs = [[0]]  # node ids through the head, per depth (depth 0: the root, run by the caller)
        slot: dict[int, int] = {}
        levels: list[list[int]] = []
        for d in range(1, layout.max_depth + 1):
            nodes = [i for i in range(n) if layout.depth[i] == d]
            assert nodes == list(range(nodes[0], nodes[0] + len(nodes))), "static_layout orders nodes by depth"
            levels.append(nodes)
            runs.append([i for i in nodes if need[i]])
            for i in runs[-1]:
                slot[i] = len(slot)
        out: list[_Level] = []
        for d, nodes in enumerate(levels, 1):
            prev, run = runs[d - 1], runs[d]
            w_prev = max(need[i] for i in prev)
            anc = torch.zeros(len(run), max(len(slot), scratch), dtype=torch.bool)
            for r, i in enumerate(run):
                while i != 0:
                    anc[r, slot[i]] = True
                    i = par[i]
            out.append(_Level(
                src=torch.tensor([prev.index(par[i]) * w_prev + layout.ranks[i] for i in nodes], device=dev),
                run=torch.tensor([nodes.index(i) for i in run], dtype=torch.long, device=dev),
                hid=torch.tensor([prev.index(par[i]) for i in run], dtype=torch.long, device=dev),
                anc=anc.to(dev), first=slot[run[0]] if run else 0, width=max((need[i] for i in run), default=0),
                start=nodes[0]))
        parents = torch.tensor(par, device=dev)[None]  # [1, N]
        depth, ancestors = ancestors_from_parents(parents, layout.max_depth)
        native_args = ([x.src for x in out], [x.run for x in out], [x.hid for x in out],
                       [x.anc.contiguous() for x in out], [x.first for x in out], [x.width for x in out])
        return cls(out, need[0], max(len(slot), scratch), (parents, depth, ancestors), n, layout.max_depth,
                   max_children, native_args, max((x.run.numel() for x in out), default=0))


class Proposer:
    """Grows BatchTrees for B rows with a draft head of either kind (draft.DraftHead borrows the
    target's embedding and LM head; eagle3.Eagle3Head borrows the embedding and has its own LM head).

    Build it after the models are on their final device and dtype: the LM-head rows of a reduced
    draft vocabulary and the EAGLE-1 layout's index tensors are prepared once, here.
    """

    def __init__(self, head: Head, target: Transformer, tree_cfg: TreeConfig, int8: bool = False) -> None:
        """int8: draft with weight-only int8 products (spec/draft_quant.py; CPU), which changes
        only which tokens are proposed, never the output."""
        self.head, self.target, self.method = head, target, tree_cfg.method
        # Sampled drafts are drawn from softmax(sharpness * logits / T) (draft.parse_draft_sharpness).
        self.sharpness = float(getattr(head, "draft_sharpness", 1.0))
        self._frame: _Frame | None = None  # set by each propose for its head forwards
        # [Vd, H], in the head's dtype: drafting runs in the head's precision whatever the target's LM head is.
        self._lm = head.lm_weight(target.lm_head.weight).to(head.fc.weight.dtype).contiguous()
        self._lm_head = lambda h: F.linear(h, self._lm)
        if int8:
            self.head = int8_head(head)
            self._lm_head = int8_linear(self._lm)
        vocab = self._lm.shape[0]
        dev = head.fc.weight.device
        self._draft_ids = head.to_target_ids(torch.arange(vocab, device=dev))  # [Vd] target id of each LM row
        self._native = native_runner(self.head, target, self._lm_head, self._draft_ids)
        if self.method == "eagle2":
            self.k = min(tree_cfg.top_k, vocab)
            pool = self.k + (tree_cfg.depth - 1) * self.k * self.k  # candidates a full expansion makes
            self.budget = min(tree_cfg.total_tokens, 1 + pool)
            # The rerank keeps a set closed under parents: no kept node is deeper than budget - 1.
            self.max_depth = min(tree_cfg.depth, self.budget - 1)
            self.scratch = max(self.max_depth - 1, 0) * self.k
            self.max_children = self.k  # bounds sampling verification's sibling loop
            # A chain (top-k 1) has a fixed shape, so sampled rows can draw its tokens from the
            # head's distribution q and be verified by the p/q rule: acceptance sum(min(p, q)) at
            # each depth instead of p(top-1 token), far higher where the target is uncertain.
            self.samples_chain = self.k == 1 and self.max_depth >= 1
            # Wider trees for sampled rows: a fixed shape (tree.sampled_layout) whose children are
            # drawn from q without replacement, verified exactly by the same p/q rounds.
            self._sampled_plan = None
            if self.k > 1 and self.max_depth >= 1:
                layout = static_layout(sampled_layout(self.budget, self.max_depth, self.k))
                self._sampled_plan = _StaticPlan.of(layout, dev, self.scratch)
                self.scratch = self._sampled_plan.scratch
            return
        self.samples_chain = False
        # EAGLE-1: a reduced vocabulary may hold fewer tokens than a node's rank asks for: drop such paths.
        layout = static_layout([c for c in tree_cfg.choices if max(c) < vocab])
        self._plan = _StaticPlan.of(layout, dev)
        # Sampled rows draw its siblings from q too, where its ranks allow it (else top-k drafts).
        self._sampled_plan = self._plan if siblings_in_rank_order(layout) else None
        self.budget, self.max_depth = self._plan.budget, self._plan.max_depth
        self.max_children, self.scratch = self._plan.max_children, self._plan.scratch

    # --- committing real pairs ---------------------------------------------------------------
    def commit(self, cache: RowKVCache, committed: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
               count: torch.Tensor, view_len: int) -> torch.Tensor:
        """Append pairs (tokens[b, j], features[b, j]), j < count[b], at slots committed[b] + j.

        tokens [B, T], features [B, T, F] (head.target_features: F = H, or 3H for EAGLE-3; the head
        fuses them), committed and count [B]; entries j >= count[b] are
        padding (written, not committed). view_len >= max(committed) + T. Sets cache.lengths to
        committed + count and returns root_hidden [B, H], the head's output at j = count - 1.
        """
        b, t = tokens.shape
        native = self._native_args(cache, t, view_len)
        if native is not None:  # one C++ call (csrc/draft_runner.cpp): the same kernels, the same bits
            out = self._native.commit(cache.k, cache.v, committed, tokens, features, count, view_len, *native)
            cache.lengths.copy_(committed + count)
            return out
        steps = torch.arange(t, device=tokens.device)
        slots = committed[:, None] + steps  # [B, T] slot = position
        causal = (steps[:, None] >= steps[None, :]).expand(b, t, t)
        mask = row_attention_mask(committed, committed, causal, view_len)  # [B, T, V]
        cache.prepare(slots, view_len)
        out = self.head(self.target.embed(tokens), features, slots, cache, mask)  # [B, T, H]
        cache.lengths.copy_(committed + count)
        last = (count - 1).clamp(min=0)[:, None, None].expand(b, 1, out.shape[-1])
        return out.gather(1, last)[:, 0]

    # --- drafting ----------------------------------------------------------------------------
    def propose(self, cache: RowKVCache, root_token: torch.Tensor, root_hidden: torch.Tensor, room: torch.Tensor,
                view_len: int, sampling: RowSampling | None = None, step: torch.Tensor | None = None) -> BatchTree:
        """A tree of `budget` nodes per row below root_token [B] (root_hidden [B, H]).

        room [B]: most nodes the row may hold (root included); nodes past it are marked invalid.
        view_len >= max(cache.lengths) + scratch. cache.lengths is left unchanged.
        sampling, step [B] (the rows' settings and step counters): when some row samples, an
        eagle2 chain's tokens are drawn from the head (`_sampled_chain`), and an eagle2 tree with
        top-k > 1 becomes the fixed sampled layout whose children are drawn from it (`_static`
        with sampling), as does an EAGLE-1 layout whose siblings are in rank order; else top-k
        drafts. Greedy rows of such a batch take the top-k tokens.
        """
        b, n = root_token.shape[0], self.budget
        probs = None
        sampled = sampling is not None and not sampling.all_greedy
        self._frame = _Frame.of(cache.lengths, self.scratch, view_len)
        if n == 1:
            parents = torch.full((b, 1), -1, dtype=torch.long, device=root_token.device)
            tokens, (depth, ancestors) = root_token[:, None], ancestors_from_parents(parents, 0)
        elif self.samples_chain and sampled:
            drafting = self._drafting(sampling)
            native = None if sampling.any_top_k or sampling.any_top_p else self._native_args(cache, 1, view_len)
            if native is not None:  # temperature-only rows: one C++ call, `_sampled_chain`'s draws bit for bit
                tokens, probs = self._native.sample_chain(
                    cache.k, cache.v, cache.lengths, root_token, root_hidden, self.max_depth,
                    drafting.sampling_temperature, sampling.greedy, sampling.seed, step, DRAFT,
                    self.target.config.vocab_size, view_len, *native)
            else:
                tokens, probs = self._sampled_chain(cache, root_token, root_hidden, view_len, drafting, step)
            parents = torch.arange(-1, n - 1, device=tokens.device).expand(b, n)
            depth, ancestors = ancestors_from_parents(parents, self.max_depth)
        elif self._sampled_plan is not None and sampled and SAMPLED_TREES:
            # A fixed layout (eagle2's sampled layout for top-k > 1, or EAGLE-1's) drawn from q.
            plan, drafting = self._sampled_plan, self._drafting(sampling)
            native = None
            if not (sampling.any_top_k or sampling.any_top_p):  # temperature-only rows
                native = self._native_args(cache, plan.widest, view_len)
            if native is not None:  # one C++ call (csrc/draft_runner.cpp): `_static`'s draws, bit for bit
                tokens, probs = self._native.sample_static(
                    cache.k, cache.v, cache.lengths, root_token, root_hidden, plan.root_width, *plan.native_args,
                    [x.start for x in plan.levels], self.scratch, n, drafting.sampling_temperature, sampling.greedy,
                    sampling.seed, step, DRAFT, plan.max_children, self.target.config.vocab_size, view_len, *native)
            else:
                tokens, probs = self._static(cache, root_token, root_hidden, view_len, plan, drafting, step)
            parents, depth, ancestors = (x.expand(b, *x.shape[1:]).clone() for x in plan.tree)
        elif self.method == "eagle2":
            native = self._native_args(cache, self.k, view_len)
            if native is not None:  # one C++ call (csrc/draft_runner.cpp): `_dynamic`'s trees, bit for bit
                tokens, parents, depth, ancestors = self._native.propose(
                    cache.k, cache.v, cache.lengths, root_token, root_hidden, self.k, self.max_depth, n, view_len,
                    *native)
            else:
                tokens, parents = self._dynamic(cache, root_token, root_hidden, view_len)
                depth, ancestors = ancestors_from_parents(parents, self.max_depth)
        else:
            plan = self._plan
            native = self._native_args(cache, plan.widest, view_len)
            if native is not None:  # one C++ call (csrc/draft_runner.cpp): `_static`'s tokens, bit for bit
                tokens = self._native.propose_static(cache.k, cache.v, cache.lengths, root_token, root_hidden,
                                                     plan.root_width, *plan.native_args, self.scratch, view_len,
                                                     *native)
            else:
                tokens = self._static(cache, root_token, root_hidden, view_len, plan)[0]
            parents, depth, ancestors = (x.expand(b, *x.shape[1:]).clone() for x in plan.tree)
        valid = torch.arange(n, device=tokens.device)[None] < room[:, None]
        return BatchTree(tokens, parents, depth, ancestors, valid, self.max_depth, probs)

    def _drafting(self, sampling: RowSampling) -> RowSampling:
        """The rows' settings drafts are drawn under: temperature T / sharpness, so q is
        softmax(sharpness * logits / T) (draft.parse_draft_sharpness)."""
        if self.sharpness == 1.0:
            return sampling
        return replace(sampling, temperature=sampling.temperature / self.sharpness)

    def _native_args(self, cache: RowKVCache, rows: int, view_len: int) -> tuple[float, bool] | None:
        """The attention's (scale, amx) where the draft runner takes a head forward of `rows` nodes
        per row over this cache, else None (the torch-op path below runs)."""
        runner = self._native
        k = cache.k
        if (runner is None or not NATIVE or not direct.DIRECT or attention.DECODE_KERNEL != "exact"
                or rows > attention.DECODE_ROWS or torch.is_grad_enabled() or k.dtype != torch.bfloat16
                or k.device.type != "cpu" or k.shape[-1] % 32):  # (RowKVCache.write_rotated's conditions)
            return None
        cache.check_view(view_len)
        if runner.rotary_positions() < cache.capacity:  # RoPE tables up to the cache's last slot
            cos, sin = self.head.rotary(torch.arange(cache.capacity, device=k.device)[None], k.dtype)
            runner.set_rotary(cos[0, 0], sin[0, 0])
        return attention.kernel_attention_args(None, k.shape[1], rows, view_len, k.shape[-1])[1:]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] head outputs -> [..., Vd] fp32 draft logits."""
        return self._lm_head(self.head.readout(hidden)).float()

    def _top(self, hidden: torch.Tensor, k: int, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, H] -> the k best draft tokens per node: (log-probabilities [B, T, k] fp32, target ids).
        `logits`: the nodes' draft logits when the caller has them already.

        Log-softmax in fp32 (Drafter._top's): ranking by summed log-probabilities needs the precision.
        On a CPU one kernel call (csrc/pointwise.cpp) reads the head's bf16 logits and does both."""
        if logits is None:
            logits = self._lm_head(self.head.readout(hidden))
        if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32):
            ops = ops_kernel()
            if ops is not None:
                v, i = ops.topk_logprobs(logits, k)
                return v, self.head.to_target_ids(i)
        v, i = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return v, self.head.to_target_ids(i)

    def _sampled_chain(self, cache: RowKVCache, root_token: torch.Tensor, root_hidden: torch.Tensor, view_len: int,
                       sampling: RowSampling, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain of max_depth drafted tokens per row: sampled rows draw node d's token from
        q = the head's distribution under the row's temperature / top-k / top-p (over the draft
        vocabulary), with the uniform of (seed, step, node d, DRAFT); greedy rows take the top-1
        token, as `_dynamic` does. Returns tokens [B, N] and draft_probs [B, N, V] fp32: row i
        holds the q node i's child was drawn from (zeros at the leaf; unused for greedy rows)."""
        b, dev = root_token.shape[0], root_token.device
        vocab = self.target.config.vocab_size
        ids = self._draft_ids.expand(b, -1)  # [B, Vd]
        slots = torch.arange(self.scratch, device=dev)
        tokens, probs = [root_token], []
        hidden = root_hidden[:, None]  # [B, 1, H] the head's output at the newest node
        anc = torch.zeros(b, 1, self.scratch, dtype=torch.bool, device=dev)
        for d in range(1, self.max_depth + 1):
            logits = self._logits(hidden[:, 0])  # [B, Vd]
            q = row_probabilities(logits, sampling)  # [B, Vd]
            node = torch.full((b,), d, dtype=torch.long, device=dev)
            drawn = self._draft_ids[draw(q, uniforms(sampling.seed, step, node, DRAFT))]
            top = self._top(hidden, 1, logits[:, None])[1][:, 0, 0]  # greedy rows: `_dynamic`'s choice
            tok = torch.where(sampling.greedy, top, drawn)  # [B] target ids
            probs.append(torch.zeros(b, vocab, device=dev).scatter_(1, ids, q))
            tokens.append(tok)
            if d < self.max_depth:  # the leaf needs no head forward
                anc = anc | (slots == d - 1)  # | own slot
                hidden = self._run(cache, tok[:, None], hidden, anc, d - 1, d, view_len)  # [B, 1, H]
        probs.append(torch.zeros(b, vocab, device=dev))
        return torch.stack(tokens, 1), torch.stack(probs, 1)

    def _run(self, cache: RowKVCache, tokens: torch.Tensor, parent_hidden: torch.Tensor, anc: torch.Tensor,
             first: int, depth: int, view_len: int) -> torch.Tensor:
        """One head forward over T nodes of one depth per row, written at scratch slots first + 0..T-1.

        tokens [B, T]; parent_hidden [B, T, H]; anc [B, T, S] their ancestor-or-self scratch slots."""
        b, t = tokens.shape
        frame = self._frame
        pos = (frame.committed + depth - 1)[:, None].expand(b, t)
        cache.prepare(frame.slots[:, first:first + t], view_len)
        return self.head.step(self.target.embed(tokens), parent_hidden, pos, cache, frame.mask(anc))  # [B, T, H]

    def _static(self, cache: RowKVCache, root_token: torch.Tensor, root_hidden: torch.Tensor, view_len: int,
                plan: _StaticPlan, sampling: RowSampling | None = None,
                step: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """EAGLE-1 (Drafter._draft_static): node i's token is child rank[i] of its parent's top list.

        sampling, step: sampled rows draw their children from q instead (`_children`). Returns
        tokens [B, N] and, when sampling, draft_probs [B, N, V] (row i: the q node i's children
        were drawn from; zeros at leaves), else None."""
        b = root_token.shape[0]
        probs = None
        if sampling is not None:
            probs = torch.zeros(b, plan.budget, self.target.config.vocab_size, device=root_token.device)
        root = torch.zeros(1, dtype=torch.long, device=root_token.device)
        top = self._children(root_hidden[:, None], plan.root_width, root, plan.max_children, sampling, step, probs)
        hidden = root_hidden[:, None]  # [B, R, H] outputs of the previous depth's run nodes
        tokens = [root_token[:, None]]
        for d, lv in enumerate(plan.levels, 1):
            level = top.flatten(1).index_select(1, lv.src)  # [B, L]
            tokens.append(level)
            if lv.run.numel() == 0:  # the deepest level: leaves only
                break
            hidden = self._run(cache, level.index_select(1, lv.run), hidden.index_select(1, lv.hid),
                               lv.anc.expand(b, -1, -1), lv.first, d, view_len)  # [B, R, H]
            top = self._children(hidden, lv.width, lv.start + lv.run, plan.max_children, sampling, step, probs)
        return torch.cat(tokens, dim=1), probs  # [B, N]

    def _children(self, hidden: torch.Tensor, width: int, nodes: torch.Tensor, max_children: int,
                  sampling: RowSampling | None, step: torch.Tensor | None,
                  probs: torch.Tensor | None) -> torch.Tensor:
        """The children table of R nodes (ids `nodes` [R], outputs hidden [B, R, H]): [B, R, width]
        target ids. Greedy rows (and every row when sampling is None) take the top-`width` drafts.
        Sampled rows draw them from q = the head's distribution under the row's settings, without
        replacement: rank r from q with ranks 0..r-1 removed (`_without`; `draw` renormalises), which
        is the q that verification holds when it reaches rank r (it removes each rejected draft the
        same way).
        The draw of rank r below node i uses the DRAFT uniform of id i * max_children + r; q is
        stored in probs[:, nodes] over the target vocabulary."""
        if sampling is None:
            return self._top(hidden, width)[1]
        b, r, _ = hidden.shape
        logits = self._logits(hidden)  # [B, R, Vd]
        top = self._top(hidden, width, logits)[1]
        q = row_probabilities(logits, sampling)  # [B, R, Vd]
        ids = self._draft_ids.expand(b * r, -1)
        probs[:, nodes] = torch.zeros(b * r, probs.shape[-1], device=q.device).scatter_(
            1, ids, q.flatten(0, 1)).view(b, r, -1)
        left = q.flatten(0, 1)  # [B*R, Vd]
        drawn = []
        for rank in range(width):
            u = uniforms(sampling.seed, step, (nodes * max_children + rank).expand(b, r), DRAFT)  # [B, R]
            x = draw(left, u.flatten())  # [B*R] draft ids
            drawn.append(self._draft_ids[x].view(b, r))
            if rank + 1 < width:
                left = _without(left, x)
        return torch.where(sampling.greedy[:, None, None], top, torch.stack(drawn, -1))

    def _dynamic(self, cache: RowKVCache, root_token: torch.Tensor, root_hidden: torch.Tensor,
                 view_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-2 (Drafter._draft_dynamic): expand the K best nodes per depth, then rerank the pool.

        Pool ids: 0 = root, candidate c (in creation order) = c + 1. Returns tokens, parents [B, N]."""
        b, k, n, s = root_token.shape[0], self.k, self.budget, self.scratch
        dev = root_token.device
        val, tok = self._top(root_hidden[:, None], k)  # [B, 1, K]
        vals, toks = [val[:, 0]], [tok[:, 0]]  # the candidate pool, one [B, *] block per depth
        pars = [torch.zeros(b, k, dtype=torch.long, device=dev)]  # pool id of each candidate's parent
        f_id = torch.arange(1, k + 1, device=dev).expand(b, k)  # [B, K] the frontier: pool ids,
        f_val, f_tok = val[:, 0], tok[:, 0]  # [B, K] cumulative log-probabilities, tokens,
        f_hid = root_hidden[:, None].expand(b, k, -1)  # [B, K, H] their parents' outputs,
        f_anc = torch.zeros(b, k, s, dtype=torch.bool, device=dev)  # [B, K, S] their ancestors' slots
        ks = torch.arange(k, device=dev)
        for d in range(1, self.max_depth):
            first = (d - 1) * k
            f_anc = f_anc | (torch.arange(s, device=dev) == first + ks[:, None])  # | own slot
            out = self._run(cache, f_tok, f_hid, f_anc, first, d, view_len)  # [B, K, H]
            c_val, c_tok = self._top(out, k)  # [B, K, K] children of each frontier node
            total = (f_val[:, :, None] + c_val).flatten(1)  # [B, K*K]
            base = 1 + k + (d - 1) * k * k  # pool id of this depth's first child
            vals.append(total)
            toks.append(c_tok.flatten(1))
            pars.append(f_id[:, :, None].expand(b, k, k).flatten(1))
            # [B, K] next frontier, as indices into the K*K children; ties to the earlier child
            best = total.argsort(dim=1, descending=True, stable=True)[:, :k]
            f_val = total.gather(1, best)
            src = best // k  # [B, K] their parents' frontier index
            f_id, f_tok = base + best, toks[-1].gather(1, best)
            f_hid = out.gather(1, src[:, :, None].expand(b, k, out.shape[-1]))
            f_anc = f_anc.gather(1, src[:, :, None].expand(b, k, s))
        # Rerank (tree.rerank): value desc, ties to the shallower then earlier candidate. Creation
        # order already has non-decreasing depth, so a stable descending sort gives that order, and
        # sorting the kept ids puts parents before children.
        vals_t = torch.cat(vals, dim=1)  # [B, M]
        keep = vals_t.argsort(dim=1, descending=True, stable=True)[:, : n - 1].sort(dim=1).values  # [B, N-1]
        node = torch.arange(1, n, device=dev).expand(b, n - 1)
        new_id = torch.zeros(b, 1 + vals_t.shape[1], dtype=torch.long, device=dev).scatter_(1, keep + 1, node)
        parents = new_id.gather(1, torch.cat(pars, dim=1).gather(1, keep))  # [B, N-1]; kept sets are parent-closed
        tokens = torch.cat((root_token[:, None], torch.cat(toks, dim=1).gather(1, keep)), dim=1)
        parents = torch.cat((torch.full((b, 1), -1, dtype=torch.long, device=dev), parents), dim=1)
        return tokens, parents


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q [R, V] with token x [R] removed: what the next sibling is drawn from. Verification
    renormalises q after it rejects x; `draw` scales by the row's total, so the draw is from that
    same distribution (and csrc/draft_runner.cpp gets the same bits without a sum of its own). A
    row with no mass left draws a token it never accepts."""
    return q.scatter(1, x[:, None], 0.0)


def native_runner(head: Head, target: Transformer, lm_head, draft_ids: torch.Tensor):
    """csrc/draft_runner.cpp's DraftRunner for this head, or None where it does not apply: it runs
    a one-layer EAGLE-1/2 head on a CPU in bf16 whose fc, layer and LM-head products are all int8
    (W8A8) kernels the layer stack can call (`int8=True` drafting), beside the target's bf16
    embedding table. EAGLE-3 heads, deeper heads, other products and devices keep the torch ops."""
    ops = ops_kernel()
    embed = target.embed.weight
    norm = head.layer.mlp_norm.weight if isinstance(head, DraftHead) else None  # (the products may hold no float weight)
    if (ops is None or not hasattr(ops, "DraftRunner") or norm is None or len(head.more)
            or norm.dtype != torch.bfloat16 or norm.device.type != "cpu"
            or embed.dtype != torch.bfloat16 or embed.device.type != "cpu"):
        return None
    plan = head.layer.direct_plan()
    layer = None if plan is None else direct.layer_stack([plan])
    fc = direct.product_parts(head.fc, with_bias=True)
    lm = direct.product_parts(lm_head) if isinstance(lm_head, torch.nn.Module) else None
    if layer is None or fc is None or lm is None:
        return None
    ids = None if head.vocab is None else draft_ids.contiguous()
    return ops.DraftRunner(embed.contiguous(), *fc, head.fc.bias, layer, *lm, ids)


# Whether drafting takes csrc/draft_runner.cpp where it applies (tests of the torch-op path and A/B
# scripts turn it off).
NATIVE = True

# Whether sampled rows of an eagle2 tree with top-k > 1 (or of an EAGLE-1 layout) draw siblings
# from q (else top-k drafts, the reranked tree for eagle2, verified with q(x) = 1; A/B scripts
# switch it per arm).
SAMPLED_TREES = True
