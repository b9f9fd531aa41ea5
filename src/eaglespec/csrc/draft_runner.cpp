// EAGLE-1/2 drafting with a one-layer EAGLE-1/2 head on a CPU, as one call per phase of a step:
// `commit` (accepted pairs into the head's KV cache), `propose` (a dynamic tree for every row),
// `propose_static` (EAGLE-1's fixed layout), `sample_chain` (a chain drawn from the head's
// distribution, for temperature-only sampled rows) and `sample_static` (an eagle2 sampled layout:
// siblings drawn from that distribution without replacement).
//
// Why: spec/propose.py's Proposer ran a (3, 2, 1) step's drafting and committing as ~270 torch ops
// (masks, gathers, the frontier's top-k, the rerank's sorts, RoPE tables) around a dozen kernel
// calls. On a 2-core EPYC they took ~4.6 ms a step, of which ~1.2 ms were the int8 products: the
// rest was op and Python overhead. Here the same kernels (the int8 products, topk_logprobs, the layer through
// LayerStack) get the same inputs in the same order, and the tree bookkeeping is plain loops over
// a few dozen numbers per row, so the trees are Proposer's, bit for bit (tests/test_draft_runner.py).
//
// Layouts are Proposer's (spec/propose.py): the head's cache holds the committed pairs at slots
// [0, committed[b]); a depth-d frontier node j runs at scratch slot committed[b] + (d - 1) K + j,
// position committed[b] + d - 1, and attends to the committed slots, its ancestors' scratch slots
// and its own. The frontier of the next depth is the K best children by summed log-probability,
// ties to the earlier child (a stable order, which Proposer and Drafter use too).

#include "layer_stack.h"
#include "ops.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

// The K best of vals[0..n) by value, descending; equal values keep their index order.
std::vector<int64_t> stable_best(const float* vals, int64_t n, int64_t k) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return vals[a] > vals[b]; });
  order.resize(std::min(k, n));
  return order;
}

}  // namespace

class DraftRunner {
 public:
  // embed [V, H] bf16: the target's token embedding; fc: the head's fusing product (int8, [2H] ->
  // [H]) and its bias or None; layer: a one-layer LayerStack of the head's decoder layer; lm: the
  // draft-vocabulary LM head's product ([H] -> [Vd]); draft_ids [Vd] long: the target id of each
  // LM row, or None for the full vocabulary.
  DraftRunner(torch::Tensor embed, uintptr_t fc_fn, torch::Tensor fc_a, torch::Tensor fc_b,
              c10::optional<torch::Tensor> fc_bias, const LayerStack& layer, uintptr_t lm_fn, torch::Tensor lm_a,
              torch::Tensor lm_b, c10::optional<torch::Tensor> draft_ids)
      : embed_(std::move(embed)),
        fc_(layer_stack::product(fc_fn, std::move(fc_a), std::move(fc_b))),
        fc_bias_(std::move(fc_bias)),
        layer_(layer),
        lm_(layer_stack::product(lm_fn, std::move(lm_a), std::move(lm_b))),
        draft_ids_(std::move(draft_ids)) {
    TORCH_CHECK(layer_.size() == 1, "DraftRunner: a one-layer head");
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == at::kBFloat16, "DraftRunner: embed [V, H] bf16");
  }

  // The head's RoPE tables for positions [0, P): cos, sin [P, hd] bf16 (Rotary's values, so the
  // same bits as computing them per call).
  void set_rotary(torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes(), "DraftRunner.set_rotary: cos, sin [P, hd]");
    cos_ = cos.contiguous(), sin_ = sin.contiguous();
  }

  int64_t rotary_positions() const { return cos_.defined() ? cos_.size(0) : 0; }

  // Proposer.commit: pairs (tokens[b, j], features[b, j]) at slots committed[b] + j over the cache
  // k, v [1, B, nkv, capacity, hd], attending over slots [0, view). Returns the head's output at
  // j = count[b] - 1: [B, H]. (The caller moves the cache's lengths.)
  torch::Tensor commit(torch::Tensor k, torch::Tensor v, torch::Tensor committed, torch::Tensor tokens,
                       torch::Tensor features, torch::Tensor count, int64_t view, double scale, bool amx) const {
    const int64_t b = tokens.size(0), t = tokens.size(1), h = embed_.size(1);
    const auto c = committed.contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    auto slots = torch::empty({b, t}, c.options());
    auto mask = torch::empty({b, t, view}, c.options().dtype(at::kBool));
    int64_t* sp = slots.data_ptr<int64_t>();
    bool* mp = mask.data_ptr<bool>();
    for (int64_t r = 0; r < b; ++r) {
      TORCH_CHECK(cp[r] >= 0 && cp[r] + t <= view, "DraftRunner.commit: the new pairs must lie inside the view");
      for (int64_t i = 0; i < t; ++i) {
        sp[r * t + i] = cp[r] + i;
        bool* row = mp + (r * t + i) * view;
        for (int64_t col = 0; col < view; ++col) row[col] = col <= cp[r] + i;  // committed, or causal in the block
      }
    }
    const auto hidden = features.to(at::kBFloat16).reshape({b * t, h});
    const auto out = forward(tokens, hidden, slots, slots, mask, k, v, view, scale, amx);  // [B*T, H]
    const auto cnt = count.contiguous();
    auto last = torch::empty({b}, c.options());
    for (int64_t r = 0; r < b; ++r) {
      last.data_ptr<int64_t>()[r] = r * t + std::max<int64_t>(cnt.data_ptr<int64_t>()[r] - 1, 0);
    }
    return out.index_select(0, last);
  }

  // Proposer._dynamic for every row, then the tree's depths and ancestor sets: (tokens, parents,
  // depth [B, N] long, ancestors [B, N, N] bool) below root_token [B] with root_hidden [B, H]; K =
  // top_k, `depth` = max_depth, N = budget. The cache as in `commit`; committed [B] its lengths.
  std::vector<torch::Tensor> propose(torch::Tensor k, torch::Tensor v, torch::Tensor committed, torch::Tensor root_token,
                                     torch::Tensor root_hidden, int64_t top_k, int64_t depth, int64_t budget,
                                     int64_t view, double scale, bool amx) const {
    const int64_t b = root_token.size(0), K = top_k, S = (depth - 1) * K;
    const auto c = committed.contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    const auto opts = c.options();
    // The candidate pool of each row, in creation order (Proposer's pool ids minus one).
    std::vector<std::vector<float>> val(b);
    std::vector<std::vector<int64_t>> tok(b), par(b);
    // The frontier: pool ids, summed log-probabilities, tokens, ancestor-or-self scratch slots.
    std::vector<int64_t> f_id(b * K), f_tok(b * K);
    std::vector<float> f_val(b * K);
    std::vector<uint8_t> f_anc(b * K * std::max<int64_t>(S, 1), 0);
    {
      const auto top = topk_logprobs(lm_(root_hidden.contiguous()), K);  // [B, K] each
      const float* tv = top[0].data_ptr<float>();
      const int64_t* ti = top[1].data_ptr<int64_t>();
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t j = 0; j < K; ++j) {
          val[r].push_back(tv[r * K + j]);
          tok[r].push_back(target_id(ti[r * K + j]));
          par[r].push_back(0);
          f_id[r * K + j] = j + 1, f_val[r * K + j] = tv[r * K + j], f_tok[r * K + j] = tok[r].back();
        }
      }
    }
    // [B*K, H] the frontier's parents' outputs: the root's for depth 1.
    torch::Tensor f_hidden = root_hidden.contiguous().repeat_interleave(K, 0);
    std::vector<float> total(K * K);
    for (int64_t d = 1; d < depth; ++d) {
      const int64_t first = (d - 1) * K, base = 1 + K + (d - 1) * K * K;
      for (int64_t n = 0; n < b * K; ++n) f_anc[n * S + first + n % K] = 1;  // | own slot
      const auto out = run_depth(k, v, cp, b, K, S, d, first, f_tok.data(), f_anc.data(), f_hidden, view, scale, amx);
      const auto top = topk_logprobs(lm_(out), K);  // [B*K, K] each: the children of each frontier node
      const float* tv = top[0].data_ptr<float>();
      const int64_t* ti = top[1].data_ptr<int64_t>();
      auto src = torch::empty({b * K}, opts);  // next frontier's parents, as rows of `out`
      std::vector<int64_t> n_id(b * K), n_tok(b * K);
      std::vector<float> n_val(b * K);
      std::vector<uint8_t> n_anc(f_anc.size());
      for (int64_t r = 0; r < b; ++r) {
        const int64_t pool = static_cast<int64_t>(tok[r].size());  // this depth's first child, minus one
        for (int64_t j = 0; j < K; ++j) {
          for (int64_t i = 0; i < K; ++i) {
            const int64_t row = (r * K + j) * K + i;
            total[j * K + i] = f_val[r * K + j] + tv[row];
            val[r].push_back(total[j * K + i]);
            tok[r].push_back(target_id(ti[row]));
            par[r].push_back(f_id[r * K + j]);
          }
        }
        const auto best = stable_best(total.data(), K * K, K);
        for (int64_t j = 0; j < K; ++j) {
          const int64_t n = r * K + j, parent = r * K + best[j] / K;
          n_id[n] = base + best[j], n_val[n] = total[best[j]], n_tok[n] = tok[r][pool + best[j]];
          src.data_ptr<int64_t>()[n] = parent;
          std::copy_n(f_anc.data() + parent * S, S, n_anc.data() + n * S);
        }
      }
      f_id.swap(n_id), f_val.swap(n_val), f_tok.swap(n_tok), f_anc.swap(n_anc);
      f_hidden = out.index_select(0, src);
    }
    return rerank(root_token, val, tok, par, budget, opts);
  }

  // Proposer._sampled_chain for temperature-only rows: a chain of `depth` drafted tokens per row.
  // Node d's token is drawn from q = softmax(logits / temperature[b]) over the draft vocabulary with
  // the uniform of (seed, step, d, purpose), or is the top-1 token where greedy[b]. Returns tokens
  // [B, depth + 1] (the root first) and the q each node's child was drawn from, scattered over the
  // target's `vocab` ids: [B, depth + 1, vocab] fp32 (zeros at the leaf).
  std::vector<torch::Tensor> sample_chain(torch::Tensor k, torch::Tensor v, torch::Tensor committed,
                                          torch::Tensor root_token, torch::Tensor root_hidden, int64_t depth,
                                          torch::Tensor temperature, torch::Tensor greedy, torch::Tensor seed,
                                          torch::Tensor step, int64_t purpose, int64_t vocab, int64_t view,
                                          double scale, bool amx) const {
    const int64_t b = root_token.size(0), S = depth - 1;
    const auto c = committed.contiguous(), root = root_token.contiguous(), greedy_rows = greedy.contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    auto tokens = torch::empty({b, depth + 1}, c.options());
    auto probs = torch::zeros({b, depth + 1, vocab}, c.options().dtype(at::kFloat));
    int64_t* tp = tokens.data_ptr<int64_t>();
    float* pp = probs.data_ptr<float>();
    std::vector<int64_t> tok(b);
    std::vector<uint8_t> anc(b * std::max<int64_t>(S, 1), 0);
    torch::Tensor hidden = root_hidden.contiguous();  // [B, H] the newest node's head output
    for (int64_t r = 0; r < b; ++r) tp[r * (depth + 1)] = root.data_ptr<int64_t>()[r];
    for (int64_t d = 1; d <= depth; ++d) {
      const auto logits = lm_(hidden).to(at::kFloat);  // [B, Vd], as Proposer._logits
      const auto q = softmax_rows(logits, temperature);  // [B, Vd] fp32
      const auto drawn = draw_rows(q, uniforms_rows(seed, step, torch::full({b}, d, c.options()), purpose));
      const auto top = topk_logprobs(logits, 1)[1];  // [B, 1]
      const int64_t vd = q.size(1);
      const float* qp = q.data_ptr<float>();
      for (int64_t r = 0; r < b; ++r) {
        const int64_t idx = greedy_rows.data_ptr<bool>()[r] ? top.data_ptr<int64_t>()[r] : drawn.data_ptr<int64_t>()[r];
        tok[r] = tp[r * (depth + 1) + d] = target_id(idx);
        float* row = pp + (r * (depth + 1) + d - 1) * vocab;
        for (int64_t j = 0; j < vd; ++j) row[target_id(j)] = qp[r * vd + j];
      }
      if (d < depth) {  // the leaf needs no head forward
        for (int64_t r = 0; r < b; ++r) anc[r * S + d - 1] = 1;  // | own slot
        hidden = run_depth(k, v, cp, b, 1, S, d, d - 1, tok.data(), anc.data(), hidden, view, scale, amx);
      }
    }
    return {tokens, probs};
  }

  // Proposer._static (EAGLE-1): tokens [B, N] of a fixed layout below root_token [B]. Level i
  // (depth i + 1) takes node l's token from its parent's top list: entry src[i][l] of the previous
  // level's run nodes' top tables, flattened (the root's table has root_width entries); its nodes
  // run[i] with children go through the head at scratch slots first[i] + 0.., their parents'
  // outputs at rows hid[i] of the previous run, seeing the scratch slots anc[i] [R, S], and get
  // top tables of width[i]. Other arguments as in `propose`.
  torch::Tensor propose_static(torch::Tensor k, torch::Tensor v, torch::Tensor committed, torch::Tensor root_token,
                               torch::Tensor root_hidden, int64_t root_width, std::vector<torch::Tensor> src,
                               std::vector<torch::Tensor> run, std::vector<torch::Tensor> hid,
                               std::vector<torch::Tensor> anc, std::vector<int64_t> first, std::vector<int64_t> width,
                               int64_t S, int64_t view, double scale, bool amx) const {
    auto top_ids = [&](const torch::Tensor& hidden, int64_t w, const std::vector<int64_t>&) {  // [rows, w] target ids
      const auto idx = topk_logprobs(lm_(hidden), w)[1];
      std::vector<int64_t> ids(idx.numel());
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = target_id(idx.data_ptr<int64_t>()[i]);
      return ids;
    };
    return walk_static(k, v, committed, root_token, root_hidden, root_width, src, run, hid, anc, first, width, {}, S,
                       view, scale, amx, top_ids);
  }

  // Proposer._static with sampling (an eagle2 sampled layout, temperature-only rows): the walk of
  // `propose_static`, but a sampled row's children table below node i is drawn from q =
  // softmax(logits / temperature[b]) over the draft vocabulary without replacement
  // (Proposer._children): rank j from q with the ranks before it zeroed, by the uniform of (seed,
  // step, i * max_children + j, purpose); greedy rows keep the top tables. starts[i]: the node id
  // of level i's first node. Returns tokens [B, N] and the q each node's children were drawn
  // from, over the target's `vocab` ids: [B, N, vocab] fp32 (zeros at leaves).
  std::vector<torch::Tensor> sample_static(torch::Tensor k, torch::Tensor v, torch::Tensor committed,
                                           torch::Tensor root_token, torch::Tensor root_hidden, int64_t root_width,
                                           std::vector<torch::Tensor> src, std::vector<torch::Tensor> run,
                                           std::vector<torch::Tensor> hid, std::vector<torch::Tensor> anc,
                                           std::vector<int64_t> first, std::vector<int64_t> width,
                                           std::vector<int64_t> starts, int64_t S, int64_t nodes,
                                           torch::Tensor temperature, torch::Tensor greedy, torch::Tensor seed,
                                           torch::Tensor step, int64_t purpose, int64_t max_children, int64_t vocab,
                                           int64_t view, double scale, bool amx) const {
    const int64_t b = root_token.size(0);
    const auto greedy_rows = greedy.contiguous();
    const auto opts = committed.options();
    auto probs = torch::zeros({b, nodes, vocab}, opts.dtype(at::kFloat));
    float* pp = probs.data_ptr<float>();
    auto drawn_ids = [&](const torch::Tensor& hidden, int64_t w, const std::vector<int64_t>& ids) {
      const int64_t R = static_cast<int64_t>(ids.size());
      const auto logits = lm_(hidden).to(at::kFloat);  // [B * R, Vd], as Proposer._logits
      const int64_t vd = logits.size(1);
      const auto q = softmax_rows(logits.view({b, R, vd}), temperature).view({b * R, vd});
      const auto top = topk_logprobs(logits, w)[1];  // [B * R, w]
      const float* qp = q.data_ptr<float>();
      for (int64_t r = 0; r < b; ++r)
        for (int64_t j = 0; j < R; ++j) {
          float* row = pp + (r * nodes + ids[j]) * vocab;
          for (int64_t x = 0; x < vd; ++x) row[target_id(x)] = qp[(r * R + j) * vd + x];
        }
      auto left = q.clone();
      auto node = torch::empty({b, R}, opts);
      std::vector<int64_t> out(b * R * w);
      for (int64_t rank = 0; rank < w; ++rank) {
        for (int64_t r = 0; r < b; ++r)
          for (int64_t j = 0; j < R; ++j) node.data_ptr<int64_t>()[r * R + j] = ids[j] * max_children + rank;
        const auto x = draw_rows(left, uniforms_rows(seed, step, node, purpose).view({-1}));  // [B * R]
        const int64_t* xp = x.data_ptr<int64_t>();
        float* lp = left.data_ptr<float>();
        for (int64_t n = 0; n < b * R; ++n) {
          const bool g = greedy_rows.data_ptr<bool>()[n / R];
          out[n * w + rank] = target_id(g ? top.data_ptr<int64_t>()[n * w + rank] : xp[n]);
          lp[n * vd + xp[n]] = 0.f;  // without replacement (Proposer's _without)
        }
      }
      return out;
    };
    auto tokens = walk_static(k, v, committed, root_token, root_hidden, root_width, src, run, hid, anc, first, width,
                              starts, S, view, scale, amx, drawn_ids);
    return {tokens, probs};
  }

 private:
  // The walk down a fixed layout shared by propose_static and sample_static; table(hidden [rows, H],
  // w, node ids of the level's run nodes) gives each run node's children table, [B * R * w] target
  // ids, row-major (starts empty: the ids are not needed).
  template <class Table>
  torch::Tensor walk_static(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& committed,
                            const torch::Tensor& root_token, const torch::Tensor& root_hidden, int64_t root_width,
                            const std::vector<torch::Tensor>& src, const std::vector<torch::Tensor>& run,
                            const std::vector<torch::Tensor>& hid, const std::vector<torch::Tensor>& anc,
                            const std::vector<int64_t>& first, const std::vector<int64_t>& width,
                            const std::vector<int64_t>& starts, int64_t S, int64_t view, double scale, bool amx,
                            Table table) const {
    const int64_t b = root_token.size(0);
    const auto c = committed.contiguous(), root = root_token.contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> tokens(b);
    for (int64_t r = 0; r < b; ++r) tokens[r].push_back(root.data_ptr<int64_t>()[r]);
    std::vector<int64_t> top = table(root_hidden.contiguous(), root_width, {0});  // [B, W]: per row, flattened
    int64_t table_width = root_width;  // entries per row of `top`
    torch::Tensor hidden = root_hidden.contiguous();  // [B * R', H] the previous run's outputs
    int64_t prev_run = 1;
    for (size_t i = 0; i < src.size(); ++i) {
      const int64_t L = src[i].size(0), R = run[i].size(0);
      const int64_t *sp = src[i].data_ptr<int64_t>(), *rp = run[i].data_ptr<int64_t>(), *hp = hid[i].data_ptr<int64_t>();
      std::vector<int64_t> level(b * L);
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t l = 0; l < L; ++l) level[r * L + l] = top[r * table_width + sp[l]];
        tokens[r].insert(tokens[r].end(), level.begin() + r * L, level.begin() + (r + 1) * L);
      }
      if (R == 0) break;  // the deepest level: leaves only
      std::vector<int64_t> tok(b * R), ids(R);
      std::vector<uint8_t> bits(b * R * S);
      auto rows = torch::empty({b * R}, c.options());  // parents' outputs: rows of `hidden`
      int64_t* row_p = rows.data_ptr<int64_t>();
      const bool* ap = anc[i].data_ptr<bool>();
      for (int64_t j = 0; j < R; ++j) ids[j] = (starts.empty() ? 0 : starts[i]) + rp[j];
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t j = 0; j < R; ++j) {
          tok[r * R + j] = level[r * L + rp[j]];
          row_p[r * R + j] = r * prev_run + hp[j];
          std::copy_n(ap + j * S, S, bits.data() + (r * R + j) * S);
        }
      }
      hidden = run_depth(k, v, cp, b, R, S, static_cast<int64_t>(i) + 1, first[i], tok.data(), bits.data(),
                         hidden.index_select(0, rows), view, scale, amx);  // [B * R, H]
      top = table(hidden, width[i], ids);
      table_width = R * width[i], prev_run = R;
    }
    const int64_t n = static_cast<int64_t>(tokens[0].size());
    auto out = torch::empty({b, n}, c.options());
    for (int64_t r = 0; r < b; ++r) std::copy(tokens[r].begin(), tokens[r].end(), out.data_ptr<int64_t>() + r * n);
    return out;
  }

  int64_t target_id(int64_t idx) const {
    if (!draft_ids_.has_value()) return idx;
    const int64_t n = draft_ids_->size(0);
    return draft_ids_->data_ptr<int64_t>()[idx < 0 ? idx + n : idx];  // (torch indexing's wrap)
  }

  // The head over `width` nodes per row at drafting depth d: node j of row r (token tok[r * width
  // + j], parent output hidden[r * width + j]) runs at scratch slot committed[r] + first + j and
  // position committed[r] + d - 1, and sees the committed slots and the scratch slots s < S with
  // anc[(r * width + j) * S + s]. Returns the nodes' outputs [B * width, H].
  torch::Tensor run_depth(const torch::Tensor& k, const torch::Tensor& v, const int64_t* cp, int64_t b, int64_t width,
                          int64_t S, int64_t d, int64_t first, const int64_t* tok, const uint8_t* anc,
                          const torch::Tensor& hidden, int64_t view, double scale, bool amx) const {
    const auto opts = torch::TensorOptions().dtype(at::kLong);
    auto tokens = torch::empty({b, width}, opts), pos = torch::empty({b, width}, opts);
    auto slots = torch::empty({b, width}, opts);
    auto mask = torch::empty({b, width, view}, opts.dtype(at::kBool));
    int64_t *tk = tokens.data_ptr<int64_t>(), *ps = pos.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
    bool* mp = mask.data_ptr<bool>();
    for (int64_t r = 0; r < b; ++r) {
      TORCH_CHECK(cp[r] >= 0 && cp[r] + S <= view, "DraftRunner: the scratch slots must lie inside the view");
      for (int64_t j = 0; j < width; ++j) {
        const int64_t n = r * width + j;
        tk[n] = tok[n], ps[n] = cp[r] + d - 1, sl[n] = cp[r] + first + j;
        bool* row = mp + n * view;
        for (int64_t col = 0; col < view; ++col) {
          const int64_t rel = col - cp[r];
          row[col] = rel < 0 || (rel < S && anc[n * S + rel]);
        }
      }
    }
    return forward(tokens, hidden, pos, slots, mask, k, v, view, scale, amx);
  }

  // The head over T nodes per row: x = fc([embed(tokens), hidden]) (+ bias), then the layer with
  // RoPE at `positions`, writing k / v at `slots`. tokens, positions, slots [B, T]; hidden [B*T, H].
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& hidden, const torch::Tensor& positions,
                        const torch::Tensor& slots, const torch::Tensor& mask, const torch::Tensor& k,
                        const torch::Tensor& v, int64_t view, double scale, bool amx) const {
    const int64_t b = tokens.size(0), t = tokens.size(1), hd = cos_.size(1);
    const auto pos = positions.reshape({-1});  // (made here: contiguous)
    const int64_t* pp = pos.data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(pp, pp + b * t, [&](int64_t p) { return 0 <= p && p < rotary_positions(); }),
                "DraftRunner: positions outside the RoPE tables");
    torch::Tensor x = fc_(at::cat({embed_.index_select(0, tokens.reshape({-1})), hidden}, 1));  // [B*T, H]
    if (fc_bias_.has_value()) x = x + *fc_bias_;
    const auto cos = cos_.index_select(0, pos).view({b, 1, t, hd}), sin = sin_.index_select(0, pos).view({b, 1, t, hd});
    return layer_.run(x, b, t, cos, sin, k, v, slots, view, mask, scale, amx, 0, 1);
  }

  // Proposer's rerank: keep the budget - 1 best candidates (value descending, ties to the earlier
  // one: parents before children), in creation order, and renumber their parents.
  std::vector<torch::Tensor> rerank(const torch::Tensor& root_token, const std::vector<std::vector<float>>& val,
                                    const std::vector<std::vector<int64_t>>& tok,
                                    const std::vector<std::vector<int64_t>>& par, int64_t n,
                                    const torch::TensorOptions& opts) const {
    const int64_t b = root_token.size(0);
    const auto root = root_token.contiguous();
    auto tokens = torch::empty({b, n}, opts), parents = torch::empty({b, n}, opts), depth = torch::empty({b, n}, opts);
    auto anc = torch::zeros({b, n, n}, opts.dtype(at::kBool));
    int64_t *tp = tokens.data_ptr<int64_t>(), *pp = parents.data_ptr<int64_t>(), *dp = depth.data_ptr<int64_t>();
    bool* ap = anc.data_ptr<bool>();
    for (int64_t r = 0; r < b; ++r) {
      const int64_t m = static_cast<int64_t>(val[r].size());
      auto keep = stable_best(val[r].data(), m, n - 1);
      std::sort(keep.begin(), keep.end());
      std::vector<int64_t> new_id(m + 1, 0);  // pool id -> node
      for (size_t j = 0; j < keep.size(); ++j) new_id[keep[j] + 1] = static_cast<int64_t>(j) + 1;
      int64_t* rt = tp + r * n;
      int64_t* rp = pp + r * n;
      int64_t* rd = dp + r * n;
      bool* ra = ap + r * n * n;
      rt[0] = root.data_ptr<int64_t>()[r], rp[0] = -1, rd[0] = 0, ra[0] = true;
      for (int64_t j = 1; j < n; ++j) {
        const int64_t cand = keep[j - 1];
        rt[j] = tok[r][cand], rp[j] = new_id[par[r][cand]], rd[j] = rd[rp[j]] + 1;
        std::copy_n(ra + rp[j] * n, n, ra + j * n);  // the parent's ancestors (parents come first)
        ra[j * n + j] = true;
      }
    }
    return {tokens, parents, depth, anc};
  }

  torch::Tensor embed_;
  layer_stack::Product fc_;
  c10::optional<torch::Tensor> fc_bias_;
  LayerStack layer_;
  layer_stack::Product lm_;
  c10::optional<torch::Tensor> draft_ids_;
  torch::Tensor cos_, sin_;
};

void bind_draft_runner(py::module_& m) {
  py::class_<DraftRunner>(m, "DraftRunner", "EAGLE-2 drafting of a one-layer head in one call (csrc/draft_runner.cpp)")
      .def(py::init<torch::Tensor, uintptr_t, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    const LayerStack&, uintptr_t, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>>(),
           py::arg("embed"), py::arg("fc_fn"), py::arg("fc_a"), py::arg("fc_b"), py::arg("fc_bias"), py::arg("layer"),
           py::arg("lm_fn"), py::arg("lm_a"), py::arg("lm_b"), py::arg("draft_ids"))
      .def("set_rotary", &DraftRunner::set_rotary, py::arg("cos"), py::arg("sin"))
      .def("rotary_positions", &DraftRunner::rotary_positions)
      .def("commit", &DraftRunner::commit, py::arg("k"), py::arg("v"), py::arg("committed"), py::arg("tokens"),
           py::arg("features"), py::arg("count"), py::arg("view"), py::arg("scale"), py::arg("amx"),
           py::call_guard<py::gil_scoped_release>())
      .def("sample_chain", &DraftRunner::sample_chain, py::arg("k"), py::arg("v"), py::arg("committed"),
           py::arg("root_token"), py::arg("root_hidden"), py::arg("depth"), py::arg("temperature"), py::arg("greedy"),
           py::arg("seed"), py::arg("step"), py::arg("purpose"), py::arg("vocab"), py::arg("view"), py::arg("scale"),
           py::arg("amx"), py::call_guard<py::gil_scoped_release>())
      .def("propose_static", &DraftRunner::propose_static, py::arg("k"), py::arg("v"), py::arg("committed"),
           py::arg("root_token"), py::arg("root_hidden"), py::arg("root_width"), py::arg("src"), py::arg("run"),
           py::arg("hid"), py::arg("anc"), py::arg("first"), py::arg("width"), py::arg("scratch"), py::arg("view"),
           py::arg("scale"), py::arg("amx"), py::call_guard<py::gil_scoped_release>())
      .def("sample_static", &DraftRunner::sample_static, py::arg("k"), py::arg("v"), py::arg("committed"),
           py::arg("root_token"), py::arg("root_hidden"), py::arg("root_width"), py::arg("src"), py::arg("run"),
           py::arg("hid"), py::arg("anc"), py::arg("first"), py::arg("width"), py::arg("starts"), py::arg("scratch"),
           py::arg("nodes"), py::arg("temperature"), py::arg("greedy"), py::arg("seed"), py::arg("step"),
           py::arg("purpose"), py::arg("max_children"), py::arg("vocab"), py::arg("view"), py::arg("scale"),
           py::arg("amx"), py::call_guard<py::gil_scoped_release>())
      .def("propose", &DraftRunner::propose, py::arg("k"), py::arg("v"), py::arg("committed"), py::arg("root_token"),
           py::arg("root_hidden"), py::arg("top_k"), py::arg("depth"), py::arg("budget"), py::arg("view"),
           py::arg("scale"), py::arg("amx"), py::call_guard<py::gil_scoped_release>());
}
