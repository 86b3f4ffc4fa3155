// Gated DeltaNet's recurrent core on CPU, registered as torch.ops.tether.*. References: the PyTorch code of
// replicas/models/gated_deltanet.py over replicas/kernels/{causal_conv1d,gated_delta_rule}/naive.py.
//
//   conv1d_silu_step(y, x, weight_t, cu_seqlens, slots, has_initial, conv_state, snapshot_rows, conv_snapshots)
//       y = silu(causal depthwise conv of x), each sequence continuing from its slot's conv state, which
//       then holds the sequence's last W - 1 inputs
//   gated_delta_step(out, y, a, b, z, decay_rate, dt_bias, norm_weight, eps, cu_seqlens, slots, has_initial,
//                    recurrent_state, num_k_heads, scale, snapshot_rows, recurrent_snapshots)
//       per value head, token by token: q, k l2-normalised; g = -decay_rate * softplus(a + dt_bias),
//       beta = sigmoid(b); S = e^g S; S += k (beta (v - S^T k))^T; o = S^T (scale q); then, with a norm
//       weight, out = rms_norm(o) * weight * silu(z) (Qwen3.5's gated norm), else out = o
//
// Shapes: x, y [T, C] packed sequence after sequence (cu_seqlens [S + 1] int64); C = 2 H K + HV V, y's columns
// q [H K] | k [H K] | v [HV V]; weight_t [W, C] float32 (the conv weight transposed); conv_state
// [slots, C, W - 1] in x's dtype; a, b [T, HV]; z, out [T, HV V]; decay_rate = exp(A_log), dt_bias [HV] float32;
// norm_weight [V] float32 (the weight as the model dtype rounds it) or empty; recurrent_state [slots, HV, K, V]
// float32; slots [S] int64, has_initial [S] bool (false: the sequence starts from zeros, whatever its slot holds).
// Query/key head h serves value heads h HV/H .. (h + 1) HV/H - 1. x, y, a, b, z, out: float32 or bfloat16, one
// dtype; a bf16 value is rounded where the PyTorch layer rounds it (y, beta, o and the norm's products).
//
// Every sequence runs its tokens one by one, in order, whatever the step's other sequences and however its
// tokens were split into steps: the state after token t is the same bits for one 1,000-token prefill chunk,
// ten chunks, or 1,000 decode steps (checkpoints are exact, and the layer is batch invariant).
//
// Snapshots: snapshot_rows [P] int64, ascending rows of the step; after the token of row snapshot_rows[p] its
// sequence's states are copied to conv_snapshots [P, C, W - 1] and recurrent_snapshots [P, HV, K, V] (what the
// slot would hold had the step ended there): a checkpoint inside a prefill chunk, without ending the chunk.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "tether_vec.h"  // vf, VL, vload, vfma, to_float, from_float, fast_exp

namespace tether {
namespace {

constexpr int64_t kMaxWidth = 8;        // the conv's width W: 4
constexpr int64_t kChannelBlock = 128;  // conv channels per work item
constexpr int64_t kTokenBlock = 64;     // tokens whose q, k, v one value head prepares at a time

template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T> inline float rounded(float x) { return to_float(from_float<T>(x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }  // fast_exp: g++ vectorises it
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold 20

template <typename Fn> void dispatch(at::ScalarType dtype, Fn fn) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gated delta: float32 or bfloat16 only");
  if (dtype == at::kFloat) fn(float{});
  else fn(c10::BFloat16{});
}

// Checked before the parallel loops (an exception must not leave an OpenMP region).
void check_sequences(const at::Tensor& cu_seqlens, const at::Tensor& slots, const at::Tensor& has_initial,
                     int64_t num_slots, int64_t num_tokens) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous(), "cu_seqlens: int64");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  TORCH_CHECK(has_initial.scalar_type() == at::kBool && has_initial.is_contiguous(), "has_initial: bool");
  TORCH_CHECK(slots.numel() + 1 == cu_seqlens.numel() && has_initial.numel() == slots.numel(),
              "one slot and one has_initial per sequence");
  const int64_t* cu = ptr<int64_t>(cu_seqlens);
  const int64_t* slot = ptr<int64_t>(slots);
  TORCH_CHECK(cu[0] == 0 && cu[slots.numel()] == num_tokens, "cu_seqlens must span the T rows");
  for (int64_t s = 0; s < slots.numel(); ++s) {
    TORCH_CHECK(cu[s] <= cu[s + 1], "cu_seqlens must not decrease");
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "slot ", slot[s], " out of range");
  }
}

// The snapshots of rows [begin, end): indices [first, last) of the ascending snapshot_rows.
struct Snapshots {
  const int64_t* rows;
  int64_t count;
  std::pair<int64_t, int64_t> within(int64_t begin, int64_t end) const {
    const int64_t first = std::lower_bound(rows, rows + count, begin) - rows;
    return {first, std::lower_bound(rows, rows + count, end) - rows};
  }
};

Snapshots check_snapshots(const at::Tensor& rows, const at::Tensor& snapshots, int64_t num_tokens) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1, "snapshot_rows: int64 [P]");
  TORCH_CHECK(snapshots.is_contiguous() && snapshots.size(0) == rows.numel(), "snapshots: [P, ...] contiguous");
  const int64_t* r = ptr<int64_t>(rows);
  for (int64_t p = 0; p < rows.numel(); ++p)
    TORCH_CHECK(r[p] >= 0 && r[p] < num_tokens && (p == 0 || r[p - 1] < r[p]), "snapshot_rows: ascending rows");
  return {r, rows.numel()};
}

// One sequence's channels [c0, c1): a ring of the last W inputs per channel, oldest first by time.
// The conv state after time t: the inputs at times t - (W - 2) .. t.
template <typename T>
void store_history(T* state, float (*ring)[kChannelBlock], int64_t t, int64_t n, int64_t c0, int64_t width) {
  const int64_t history = width - 1;
  for (int64_t i = 0; i < history; ++i)
    for (int64_t c = 0; c < n; ++c)
      state[(c0 + c) * history + i] = from_float<T>(ring[(t + 1 - history + i + 2 * width) % width][c]);
}

template <typename T>
void conv_block(T* y, const T* x, const float* weight_t, T* state, bool has_initial, int64_t begin, int64_t end,
                int64_t c0, int64_t c1, int64_t channels, int64_t width, const Snapshots& snaps, T* snapshots) {
  const int64_t n = c1 - c0, history = width - 1;
  float ring[kMaxWidth][kChannelBlock];  // ring[(tau + W) % W]: the input at time tau (tau < 0: the state)
  for (int64_t i = 0; i < history; ++i)
    for (int64_t c = 0; c < n; ++c)
      ring[(i + 1) % width][c] = has_initial ? to_float(state[(c0 + c) * history + i]) : 0.0f;
  auto [snap, last_snap] = snaps.within(begin, end);
  for (int64_t t = 0; t < end - begin; ++t) {
    const T* row = x + (begin + t) * channels + c0;
    float* newest = ring[(t + width) % width];
    for (int64_t c = 0; c < n; ++c) newest[c] = to_float(row[c]);
    float acc[kChannelBlock] = {0};
    for (int64_t j = 0; j < width; ++j) {  // input time t - (W - 1) + j
      const float* in = ring[(t + 1 + j) % width];
      const float* w = weight_t + j * channels + c0;
      for (int64_t c = 0; c < n; ++c) acc[c] += w[c] * in[c];
    }
    T* out = y + (begin + t) * channels + c0;
    for (int64_t c = 0; c < n; ++c) out[c] = from_float<T>(acc[c] * sigmoid(acc[c]));
    if (snap < last_snap && snaps.rows[snap] == begin + t)
      store_history(snapshots + snap++ * channels * history, ring, t, n, c0, width);
  }
  store_history(state, ring, end - begin - 1, n, c0, width);
}

void conv1d_silu_step(at::Tensor y, const at::Tensor& x, const at::Tensor& weight_t, const at::Tensor& cu_seqlens,
                      const at::Tensor& slots, const at::Tensor& has_initial, at::Tensor conv_state,
                      const at::Tensor& snapshot_rows, at::Tensor conv_snapshots) {
  check_sequences(cu_seqlens, slots, has_initial, conv_state.size(0), x.size(0));
  const int64_t channels = x.size(1), width = weight_t.size(0), history = width - 1;
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && y.sizes() == x.sizes(), "x, y: [T, C] contiguous");
  TORCH_CHECK(weight_t.scalar_type() == at::kFloat && weight_t.is_contiguous() && weight_t.size(1) == channels,
              "weight_t: [W, C] float32");
  TORCH_CHECK(width >= 2 && width <= kMaxWidth, "conv width 2..", kMaxWidth);
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.size(1) == channels && conv_state.size(2) == history &&
              conv_state.scalar_type() == x.scalar_type(), "conv_state: [slots, C, W - 1] in x's dtype");
  const Snapshots snaps = check_snapshots(snapshot_rows, conv_snapshots, x.size(0));
  TORCH_CHECK(snaps.count == 0 || (conv_snapshots.scalar_type() == x.scalar_type() &&
              conv_snapshots.numel() == snaps.count * channels * history), "conv_snapshots: [P, C, W - 1]");
  const int64_t num_seqs = slots.numel(), blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  const int64_t* cu = ptr<int64_t>(cu_seqlens);
  const int64_t* slot = ptr<int64_t>(slots);
  const bool* has = ptr<bool>(has_initial);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, num_seqs * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t item = first; item < last; ++item) {
        const int64_t s = item / blocks, c0 = (item % blocks) * kChannelBlock;
        conv_block<T>(ptr<T>(y), ptr<T>(x), ptr<float>(weight_t), ptr<T>(conv_state) + slot[s] * channels * history,
                      has[s], cu[s], cu[s + 1], c0, std::min(c0 + kChannelBlock, channels), channels, width, snaps,
                      ptr<T>(conv_snapshots));
      }
    });
  });
}

// x [n] *= 1 / sqrt(sum x^2 + 1e-6) * scale (transformers' l2norm, then the query's scale)
inline void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * scale;
}

// What the recurrence reads for up to kTokenBlock tokens of one value head, prepared once per token:
// q (scaled), k l2-normalised [n][K], v [n][V], e^g and beta [n]; o [n][V] is what it writes.
struct TokenBlock {
  int64_t n = 0;
  std::vector<float> q, k, v, o, decay, beta;
  TokenBlock(int64_t head_k, int64_t head_v)
      : q(kTokenBlock * head_k), k(kTokenBlock * head_k), v(kTokenBlock * head_v), o(kTokenBlock * head_v),
        decay(kTokenBlock), beta(kTokenBlock) {}
};

// The state after a block's token `t` goes to `dest` ([K, V], this head's snapshot).
struct Snap {
  int64_t t;
  float* dest;
};

// The two lane types the recurrence runs on: a vector of VL columns, and one column (the tail of V).
template <typename L> struct Lanes;
template <> struct Lanes<vf> {
  static constexpr int64_t width = VL;
  static vf load(const float* p) { return vload(p); }
  static void store(float* p, vf v) { vstore(p, v); }
  static vf set1(float a) { return vset1(a); }
  static vf fma(vf a, vf b, vf c) { return vfma(a, b, c); }
};
template <> struct Lanes<float> {
  static constexpr int64_t width = 1;
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
  static float set1(float a) { return a; }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
};

// Columns [j0, j0 + width) of one head's state [K, V] through the block's tokens, in order. The columns of the
// delta rule are independent (S^T k, the update and S^T q act column by column), so this [K, width] slice
// stays in L1 for the whole block: per token, one pass that reads it to predict, one that decays, writes and
// reads out.
// Row sums in 4 partial accumulators (rows i mod 4 while 4 remain, the rest into the first), added in a fixed
// order: the same bits for any batch.
template <typename L>
void recur_columns(float* state, int64_t head_k, int64_t head_v, TokenBlock& blk, int64_t j0,
                   const std::vector<Snap>& snaps) {
  using A = Lanes<L>;
  size_t next = 0;
  for (int64_t t = 0; t < blk.n; ++t) {
    const float* kt = blk.k.data() + t * head_k;
    const float* qt = blk.q.data() + t * head_k;
    const L decay = A::set1(blk.decay[t]);
    L p0 = A::set1(0.0f), p1 = p0, p2 = p0, p3 = p0;  // named, not an array: g++ keeps them in registers
    auto predict = [&](int64_t i, L& part) { part = A::fma(A::set1(kt[i]), A::load(state + i * head_v + j0), part); };
    int64_t i = 0;
    for (; i + 4 <= head_k; i += 4) {
      predict(i, p0), predict(i + 1, p1), predict(i + 2, p2), predict(i + 3, p3);
    }
    for (; i < head_k; ++i) predict(i, p0);
    // predicted = (e^g S)^T k = e^g (S^T k): the decay is applied once, in the update pass
    const L predicted = decay * ((p0 + p1) + (p2 + p3));
    const L delta = (A::load(blk.v.data() + t * head_v + j0) - predicted) * A::set1(blk.beta[t]);
    L o0 = A::set1(0.0f), o1 = o0, o2 = o0, o3 = o0;
    auto update = [&](int64_t i, L& part) {  // S = e^g S + k delta^T; o = S^T q
      float* at = state + i * head_v + j0;
      const L s = A::fma(A::set1(kt[i]), delta, A::load(at) * decay);
      A::store(at, s);
      part = A::fma(A::set1(qt[i]), s, part);
    };
    for (i = 0; i + 4 <= head_k; i += 4) {
      update(i, o0), update(i + 1, o1), update(i + 2, o2), update(i + 3, o3);
    }
    for (; i < head_k; ++i) update(i, o0);
    A::store(blk.o.data() + t * head_v + j0, (o0 + o1) + (o2 + o3));
    for (; next < snaps.size() && snaps[next].t == t; ++next)
      for (int64_t i = 0; i < head_k; ++i)
        std::copy(state + i * head_v + j0, state + i * head_v + j0 + A::width, snaps[next].dest + i * head_v + j0);
  }
}

// out [V] = cast(cast(weight * cast(o / rms(o))) * silu(z)), o already rounded: GatedRMSNorm's rounding points.
template <typename T>
inline void gated_norm(T* out, const float* o, const T* z, const float* weight, float eps, int64_t n) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += o[j] * o[j];
  const float inv = 1.0f / std::sqrt(sum / n + eps);
  for (int64_t j = 0; j < n; ++j) {
    const float normed = rounded<T>(rounded<T>(o[j] * inv) * weight[j]);
    const float gate = to_float(z[j]);
    out[j] = from_float<T>(normed * (gate * sigmoid(gate)));
  }
}

// The shapes and pointers of one gated_delta_step call.
template <typename T>
struct DeltaStep {
  const T *y, *a, *b, *z;
  T* out;
  const float *decay_rate, *dt_bias, *norm_weight;  // norm_weight null: out = o
  float eps, scale;
  int64_t num_k_heads, num_v_heads, head_k, head_v, channels;

  // Tokens [t0, t0 + n) of value head hv: q, k, v as floats, q and k normalised, the gates.
  void load(TokenBlock& blk, int64_t t0, int64_t n, int64_t hv) const {
    const int64_t h = hv / (num_v_heads / num_k_heads), key_dim = num_k_heads * head_k;
    blk.n = n;
    for (int64_t t = 0; t < n; ++t) {
      const T* row = y + (t0 + t) * channels;
      float *q = blk.q.data() + t * head_k, *k = blk.k.data() + t * head_k, *v = blk.v.data() + t * head_v;
      for (int64_t i = 0; i < head_k; ++i) {
        q[i] = to_float(row[h * head_k + i]);
        k[i] = to_float(row[key_dim + h * head_k + i]);
      }
      for (int64_t j = 0; j < head_v; ++j) v[j] = to_float(row[2 * key_dim + hv * head_v + j]);
      l2_normalize(q, head_k, scale);
      l2_normalize(k, head_k, 1.0f);
      const int64_t gate = (t0 + t) * num_v_heads + hv;
      blk.decay[t] = std::exp(-decay_rate[hv] * softplus(to_float(a[gate]) + dt_bias[hv]));
      blk.beta[t] = rounded<T>(sigmoid(to_float(b[gate])));
    }
  }

  // The block's outputs, rounded, through the gated norm (or not) into out.
  void store(TokenBlock& blk, int64_t t0, int64_t hv) const {
    for (int64_t t = 0; t < blk.n; ++t) {
      float* o = blk.o.data() + t * head_v;
      for (int64_t j = 0; j < head_v; ++j) o[j] = rounded<T>(o[j]);
      const int64_t at = ((t0 + t) * num_v_heads + hv) * head_v;
      if (norm_weight != nullptr) {
        gated_norm<T>(out + at, o, z + at, norm_weight, eps, head_v);
      } else {
        for (int64_t j = 0; j < head_v; ++j) out[at + j] = from_float<T>(o[j]);
      }
    }
  }

  // One value head of one sequence, rows [begin, end), from `state` [K, V] (updated in place).
  void run(float* state, int64_t begin, int64_t end, int64_t hv, const Snapshots& snaps, float* snapshots,
           TokenBlock& blk) const {
    auto [snap, last_snap] = snaps.within(begin, end);
    std::vector<Snap> marks;
    for (int64_t t0 = begin; t0 < end; t0 += kTokenBlock) {
      const int64_t n = std::min(kTokenBlock, end - t0);
      load(blk, t0, n, hv);
      marks.clear();
      for (; snap < last_snap && snaps.rows[snap] < t0 + n; ++snap)
        marks.push_back({snaps.rows[snap] - t0, snapshots + (snap * num_v_heads + hv) * head_k * head_v});
      int64_t j0 = 0;
      for (; j0 + VL <= head_v; j0 += VL) recur_columns<vf>(state, head_k, head_v, blk, j0, marks);
      for (; j0 < head_v; ++j0) recur_columns<float>(state, head_k, head_v, blk, j0, marks);
      store(blk, t0, hv);
    }
  }
};

void gated_delta_step(at::Tensor out, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& z, const at::Tensor& decay_rate, const at::Tensor& dt_bias,
                      const at::Tensor& norm_weight, double eps, const at::Tensor& cu_seqlens, const at::Tensor& slots,
                      const at::Tensor& has_initial, at::Tensor recurrent_state, int64_t num_k_heads, double scale,
                      const at::Tensor& snapshot_rows, at::Tensor recurrent_snapshots) {
  check_sequences(cu_seqlens, slots, has_initial, recurrent_state.size(0), y.size(0));
  const Snapshots snaps = check_snapshots(snapshot_rows, recurrent_snapshots, y.size(0));
  TORCH_CHECK(snaps.count == 0 || (recurrent_snapshots.scalar_type() == at::kFloat &&
              recurrent_snapshots.numel() == snaps.count * recurrent_state[0].numel()),
              "recurrent_snapshots: [P, HV, K, V] float32");
  const int64_t num_v_heads = recurrent_state.size(1), head_k = recurrent_state.size(2),
                head_v = recurrent_state.size(3), key_dim = num_k_heads * head_k, channels = y.size(1);
  TORCH_CHECK(recurrent_state.scalar_type() == at::kFloat && recurrent_state.is_contiguous(),
              "recurrent_state: [slots, HV, K, V] float32");
  TORCH_CHECK(num_v_heads % num_k_heads == 0 && channels == 2 * key_dim + num_v_heads * head_v, "y: [T, 2HK + HV V]");
  const int64_t num_tokens = y.size(0);
  for (const at::Tensor* t : {&y, &a, &b, &z, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == y.scalar_type() && t->size(0) == num_tokens,
                "y, a, b, z, out: contiguous [T, ...] of one dtype");
  }
  TORCH_CHECK(a.size(1) == num_v_heads && b.size(1) == num_v_heads, "a, b: [T, HV]");
  TORCH_CHECK(out.numel() == num_tokens * num_v_heads * head_v && z.numel() == out.numel(), "z, out: [T, HV V]");
  TORCH_CHECK(decay_rate.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat &&
              decay_rate.numel() == num_v_heads && dt_bias.numel() == num_v_heads, "decay_rate, dt_bias: [HV] float32");
  const bool norm = norm_weight.numel() > 0;
  TORCH_CHECK(!norm || (norm_weight.scalar_type() == at::kFloat && norm_weight.numel() == head_v), "norm_weight: [V]");
  const int64_t num_seqs = slots.numel();
  const int64_t* cu = ptr<int64_t>(cu_seqlens);
  const int64_t* slot = ptr<int64_t>(slots);
  const bool* has = ptr<bool>(has_initial);
  dispatch(y.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const DeltaStep<T> step{ptr<T>(y), ptr<T>(a), ptr<T>(b), ptr<T>(z), ptr<T>(out), ptr<float>(decay_rate),
                            ptr<float>(dt_bias), norm ? ptr<float>(norm_weight) : nullptr, static_cast<float>(eps),
                            static_cast<float>(scale), num_k_heads, num_v_heads, head_k, head_v, channels};
    at::parallel_for(0, num_seqs * num_v_heads, 1, [&](int64_t first, int64_t last) {
      TokenBlock blk(head_k, head_v);
      for (int64_t item = first; item < last; ++item) {
        const int64_t s = item / num_v_heads, hv = item % num_v_heads;
        float* state = ptr<float>(recurrent_state) + (slot[s] * num_v_heads + hv) * head_k * head_v;
        if (!has[s]) std::fill(state, state + head_k * head_v, 0.0f);
        step.run(state, cu[s], cu[s + 1], hv, snaps, ptr<float>(recurrent_snapshots), blk);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("conv1d_silu_step(Tensor(a!) y, Tensor x, Tensor weight_t, Tensor cu_seqlens, Tensor slots, "
        "Tensor has_initial, Tensor(b!) conv_state, Tensor snapshot_rows, Tensor(c!) conv_snapshots) -> ()");
  m.def("gated_delta_step(Tensor(a!) out, Tensor y, Tensor a, Tensor b, Tensor z, Tensor decay_rate, "
        "Tensor dt_bias, Tensor norm_weight, float eps, Tensor cu_seqlens, Tensor slots, Tensor has_initial, "
        "Tensor(b!) recurrent_state, int num_k_heads, float scale, Tensor snapshot_rows, "
        "Tensor(c!) recurrent_snapshots) -> ()");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("conv1d_silu_step", conv1d_silu_step);
  m.impl("gated_delta_step", gated_delta_step);
}

}  // namespace tether
