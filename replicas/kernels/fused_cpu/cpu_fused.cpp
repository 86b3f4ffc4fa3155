// Fused small ops of a decoder layer on CPU, registered as torch.ops.tether.*: each replaces 4-8
// PyTorch ops (and their dispatch and temporaries) with one pass over the rows. References: naive.py.
//
//   rms_norm(out, x, weight, eps)                  out = cast(cast(x / rms(x)) * weight)
//   add_rms_norm(out, residual, h, weight, eps)    residual += h; out = rms_norm(residual)
//   rotary_embedding(qk, positions, cos, sin)      qk = qk * cos + swap_halves(qk) * sin, in place
//   silu_and_mul(out, gate_up)                     out = cast(silu(gate) * up)
//
// Math in float32; `weight`, `cos`, `sin` are float32 (the caller keeps float32 copies); x, h, out, qk,
// gate_up are float32 or bfloat16. A bf16 output rounds where the PyTorch layer rounds, and no multiply-add
// is contracted into an FMA (PyTorch's elementwise ops round each product): bf16 results then equal the
// reference's bit for bit but for rare last-bit ties, and bf16 models keep their measured distance to float32.
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <limits>

#include "tether_vec.h"  // to_float, from_float, fast_exp

namespace tether {
namespace {

constexpr int kLanes = 16;  // partial sums of a reduction: one vector register's worth, so g++ vectorizes it

template <typename T> float sum_of_squares(const T* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) { float v = to_float(x[i + j]); acc[j] += v * v; }
  float total = 0;
  for (int j = 0; j < kLanes; ++j) total += acc[j];
  for (; i < n; ++i) { float v = to_float(x[i]); total += v * v; }
  return total;
}

template <typename x_t, typename out_t>
void norm_row(out_t* out, const x_t* x, const float* weight, int64_t n, double eps) {
  float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / n + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) {
    float normed = to_float(from_float<out_t>(to_float(x[i]) * inv));  // the layer casts before scaling
    out[i] = from_float<out_t>(normed * weight[i]);
  }
}

template <typename T> T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Calls fn.template operator()<x_t, out_t>() for the dtypes of x and out.
template <typename Fn> void dispatch2(at::ScalarType x, at::ScalarType out, Fn fn) {
  TORCH_CHECK((x == at::kFloat || x == at::kBFloat16) && (out == at::kFloat || out == at::kBFloat16),
              "tether_fused: float32 or bfloat16 only");
  if (x == at::kFloat && out == at::kFloat) fn(float{}, float{});
  else if (x == at::kFloat) fn(float{}, c10::BFloat16{});
  else if (out == at::kFloat) fn(c10::BFloat16{}, float{});
  else fn(c10::BFloat16{}, c10::BFloat16{});
}

void check_rows(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == n && t.stride(1) == 1, name, ": expected [T, ", n, "] rows");
}

// x, out: [T, C]; weight: [C] float32
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  int64_t rows = x.size(0), n = x.size(1);
  check_rows(x, n, "x"); check_rows(out, n, "out");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n, "weight");
  dispatch2(x.scalar_type(), out.scalar_type(), [&](auto xv, auto ov) {
    using x_t = decltype(xv); using out_t = decltype(ov);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row(ptr<out_t>(out) + r * out.stride(0), ptr<x_t>(x) + r * x.stride(0), ptr<float>(weight), n, eps);
    });
  });
}

// residual: [T, C] float32, updated in place; h: [T, C]; out: [T, C]
void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& h, const at::Tensor& weight, double eps) {
  int64_t rows = residual.size(0), n = residual.size(1);
  check_rows(residual, n, "residual"); check_rows(h, n, "h"); check_rows(out, n, "out");
  TORCH_CHECK(residual.scalar_type() == at::kFloat, "residual must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n, "weight");
  dispatch2(h.scalar_type(), out.scalar_type(), [&](auto hv, auto ov) {
    using h_t = decltype(hv); using out_t = decltype(ov);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* res = ptr<float>(residual) + r * residual.stride(0);
        const h_t* add = ptr<h_t>(h) + r * h.stride(0);
        for (int64_t i = 0; i < n; ++i) res[i] += to_float(add[i]);
        norm_row(ptr<out_t>(out) + r * out.stride(0), res, ptr<float>(weight), n, eps);
      }
    });
  });
}

// qk: [T, heads, D] (rows may be strided, D contiguous); positions: [T] int64; cos, sin: [P, D] float32
void rotary_embedding(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  TORCH_CHECK(qk.stride(2) == 1 && dim % 2 == 0 && cos.size(1) == dim && sin.size(1) == dim, "rotary shapes");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.is_contiguous() && sin.is_contiguous(), "rotary dtypes");
  const int64_t* pos = ptr<int64_t>(positions);
  dispatch2(qk.scalar_type(), qk.scalar_type(), [&](auto xv, auto) {
    using x_t = decltype(xv);
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        int64_t t = i / heads, h = i % heads;
        x_t* x = ptr<x_t>(qk) + t * qk.stride(0) + h * qk.stride(1);
        const float* c = ptr<float>(cos) + pos[t] * dim;
        const float* s = ptr<float>(sin) + pos[t] * dim;
        for (int64_t j = 0; j < half; ++j) {  // s holds -sin in its first half, +sin in its second
          float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
          float o1 = x1 * c[j], o2 = x2 * c[j + half];
          o1 += x2 * s[j];
          o2 += x1 * s[j + half];
          x[j] = from_float<x_t>(o1);
          x[j + half] = from_float<x_t>(o2);
        }
      }
    });
  });
}

// gate_up: [T, 2I] (gate then up); out: [T, I]
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  check_rows(gate_up, 2 * width, "gate_up"); check_rows(out, width, "out");
  dispatch2(gate_up.scalar_type(), out.scalar_type(), [&](auto xv, auto ov) {
    using x_t = decltype(xv); using out_t = decltype(ov);
    at::parallel_for(0, rows * width, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin / width; r * width < end; ++r) {
        int64_t lo = std::max(begin, r * width) - r * width, hi = std::min(end, (r + 1) * width) - r * width;
        const x_t* gate = ptr<x_t>(gate_up) + r * gate_up.stride(0);
        const x_t* up = gate + width;
        out_t* o = ptr<out_t>(out) + r * out.stride(0);
        for (int64_t i = lo; i < hi; ++i) {
          float g = to_float(gate[i]);
          o[i] = from_float<out_t>(g / (1.0f + fast_exp(-g)) * to_float(up[i]));
        }
      }
    });
  });
}

// logits: [R, V] float32; bitmask: [R, ceil(V / 32)] int32, bit b of word w allows token 32 w + b; rows: the
// listed rows are masked (a disallowed token's logit becomes -inf), the others left as they are. A word of
// all ones (the common case inside a string) costs one compare.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1, "logits");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
              bitmask.size(1) * 32 >= logits.size(1) && bitmask.size(0) >= logits.size(0), "bitmask");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_rows = rows.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "apply_token_bitmask: row out of range");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = logits.data_ptr<float>() + row_ids[i] * logits.stride(0);
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + row_ids[i] * words;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, top = std::min<int64_t>(32, vocab - base);
        for (int64_t b = 0; b < top; ++b)
          if (!((word >> b) & 1u)) row[base + b] = neg_inf;
      }
    }
  });
}

}  // namespace
}  // namespace tether

TORCH_LIBRARY_FRAGMENT(tether, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor h, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) qk, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(tether, CPU, m) {
  m.impl("rms_norm", &tether::rms_norm);
  m.impl("add_rms_norm", &tether::add_rms_norm);
  m.impl("rotary_embedding", &tether::rotary_embedding);
  m.impl("silu_and_mul", &tether::silu_and_mul);
  m.impl("apply_token_bitmask", &tether::apply_token_bitmask);
}
