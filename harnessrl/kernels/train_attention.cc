// Learner-side CPU kernels: causal grouped-query attention within packed segments, forward and
// backward, as XLA FFI targets (see train_attention.py).
//
// `harnessrl_attention_fwd`: q [b, t, heads, e], k and v [b, t, kv_heads, e], segment_ids [b, t]
// → out [b, t, heads, e] and the log-sum-exp of each query's scaled scores [b, t, heads].
// `harnessrl_attention_bwd`: the same inputs plus out, lse and d_out → d_q, d_k, d_v.
// Query i of a row sees key j when j <= i and both carry the same segment id (the mask of
// `attention.segment_causal_mask`); query heads h read kv head h / (heads / kv_heads).
//
// Why: XLA:CPU runs the attention core as many small batched dots plus elementwise passes over
// `[b, heads, t, t]` score arrays, at a small fraction of its matmul rate, and computes every
// key the mask then hides. These kernels visit, for each block of queries, only the keys from the
// first one of the block's segments up to its last query, keep the scores of a few queries in
// L1, and recompute the probabilities in the backward pass from the saved log-sum-exp (as flash
// attention does) instead of storing `[b, heads, t, t]` arrays.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "task_runner.h"
#include "vectors.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 6;        // query rows (query position, head) computed together
constexpr int kChunk = 4;       // vectors of head_dim held per row: 6 x 4 accumulators + 4 loads
constexpr int kPositions = 32;  // query positions per forward task

typedef int32_t i32v __attribute__((vector_size(kLanes * 4)));

// exp(x) for 16 lanes, within about 2 ulp of expf (Cephes' polynomial on x - n ln 2, scaled by
// 2^n through the exponent bits); lanes below -87.3 (masked scores are -inf) give exactly 0.
// The library's expf is scalar: a call per score made the forward pass a third slower.
inline __attribute__((always_inline)) f32v exp16(f32v x) {
  const f32v zero = {};
  const i32v tiny = x < -87.3f;
  x = x > 88.3f ? zero + 88.3f : x;
  x = tiny ? zero : x;
  const f32v t = x * 1.44269504088896341f;
  const i32v n = __builtin_convertvector(t + (t < 0.0f ? zero - 0.5f : zero + 0.5f), i32v);
  const f32v nf = __builtin_convertvector(n, f32v);
  const f32v r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f32v p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32v bits = (n + 127) << 23;
  f32v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  p *= scale;
  return tiny ? zero : p;
}

// p[j] = exp(p[j] - shift) for j in [0, n), 16 at a time; returns their sum.
inline float exp_shifted(float* p, int64_t n, float shift) {
  f32v total = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const f32v e = exp16(load(p + j) - shift);
    store(p + j, e);
    total += e;
  }
  float rest = 0.0f;
  for (; j < n; ++j) rest += (p[j] = std::exp(p[j] - shift));
  for (int i = 0; i < kLanes; ++i) rest += total[i];
  return rest;
}

struct Shapes {
  int64_t b, t, heads, kv_heads, e, g;
  float scale;
};

// The first position of each query's segment among the keys it may see: keys [first[i], i] hold
// every key of query i, and the mask inside that range is `segment[j] == segment[i]` (packing
// gives contiguous segments, where the range is exact; any other layout stays correct).
void segment_first(const int32_t* seg, int64_t t, int32_t* first) {
  for (int64_t i = 0; i < t; ++i) {
    if (i > 0 && seg[i] == seg[i - 1]) {
      first[i] = first[i - 1];
      continue;
    }
    int64_t j = 0;
    while (seg[j] != seg[i]) ++j;  // stops at i at the latest
    first[i] = int32_t(j);
  }
}

// scores[r][j] = scale * x_r . cols[:, j] for j in [0, n): R rows, keys 16 at a time.
template <int R>
inline __attribute__((always_inline)) void row_dots(const float* const* x, const float* cols,
                                                   int64_t ld, int64_t n, int64_t e, float scale,
                                                   float* scores, int64_t sld) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    f32v acc[R] = {};
    for (int64_t c = 0; c < e; ++c) {
      const f32v col = load(cols + c * ld + j);
      for (int r = 0; r < R; ++r) acc[r] += x[r][c] * col;
    }
    for (int r = 0; r < R; ++r) store(scores + r * sld + j, acc[r] * scale);
  }
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t c = 0; c < e; ++c) s += x[r][c] * cols[c * ld + j];
      scores[r * sld + j] = s * scale;
    }
}

// out_r[c0 : c0 + 64] (+)= sum_j weights[r][j] * rows_j[c0 : c0 + 64] for R rows, j in [0, n).
template <int R>
inline __attribute__((always_inline)) void weighted_rows(const float* weights, int64_t sld,
                                                        const float* rows, int64_t stride,
                                                        int64_t n, int64_t c0, float* const* out,
                                                        float out_scale) {
  f32v acc[R][kChunk] = {};
  for (int64_t j = 0; j < n; ++j) {
    f32v row[kChunk];
    for (int v = 0; v < kChunk; ++v) row[v] = load(rows + j * stride + c0 + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float w = weights[r * sld + j];
      for (int v = 0; v < kChunk; ++v) acc[r][v] += w * row[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kChunk; ++v) store(out[r] + c0 + v * kLanes, acc[r][v] * out_scale);
}

// For each key j in [0, n): dst_j[c0 : c0 + 64] += sum_r weights[r][j] * x_r[c0 : c0 + 64].
template <int R>
inline __attribute__((always_inline)) void scatter_rows(const float* weights, int64_t sld,
                                                       const float* const* x, int64_t c0,
                                                       float* dst, int64_t stride, int64_t n) {
  f32v xs[R][kChunk];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kChunk; ++v) xs[r][v] = load(x[r] + c0 + v * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    float* d = dst + j * stride + c0;
    f32v acc[kChunk];
    for (int v = 0; v < kChunk; ++v) acc[v] = load(d + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float w = weights[r * sld + j];
      for (int v = 0; v < kChunk; ++v) acc[v] += w * xs[r][v];
    }
    for (int v = 0; v < kChunk; ++v) store(d + v * kLanes, acc[v]);
  }
}

// One block of up to kRows query rows of one (batch row, kv head): row m is query position
// pos[m], head head[m]. Keys [lo, lo + n) cover all of them.
struct Block {
  int rows;
  int64_t pos[kRows], head[kRows];
  int64_t lo, n;
};

// Blocks of rows in (position, head-in-group) order over positions [p0, p1) of one kv head.
template <typename F>
void for_blocks(const Shapes& s, int64_t kv, int64_t p0, int64_t p1, const int32_t* first, F&& f) {
  const int64_t total = (p1 - p0) * s.g;
  for (int64_t m0 = 0; m0 < total; m0 += kRows) {
    Block blk;
    blk.rows = int(std::min<int64_t>(kRows, total - m0));
    int64_t lo = s.t, hi = 0;
    for (int r = 0; r < blk.rows; ++r) {
      const int64_t m = m0 + r;
      blk.pos[r] = p0 + m / s.g;
      blk.head[r] = kv * s.g + m % s.g;
      lo = std::min<int64_t>(lo, first[blk.pos[r]]);
      hi = std::max<int64_t>(hi, blk.pos[r]);
    }
    // Whole vectors of keys: widened to a multiple of 16 (down, or up where the row ends), the
    // extra keys lie before the first of the block's segments or after its last query, so the
    // mask hides them, and no key is left to a scalar loop over strided columns.
    int64_t n = hi - lo + 1;
    const int64_t wide = (n + kLanes - 1) / kLanes * kLanes;
    if (wide <= s.t) {
      lo = std::max<int64_t>(0, std::min(lo, s.t - wide));
      n = wide;
    }
    blk.lo = lo;
    blk.n = n;
    f(blk);
  }
}

#define DISPATCH_ROWS(KERNEL, ...)         \
  switch (rows) {                          \
    case 1: KERNEL<1>(__VA_ARGS__); break; \
    case 2: KERNEL<2>(__VA_ARGS__); break; \
    case 3: KERNEL<3>(__VA_ARGS__); break; \
    case 4: KERNEL<4>(__VA_ARGS__); break; \
    case 5: KERNEL<5>(__VA_ARGS__); break; \
    default: KERNEL<6>(__VA_ARGS__); break; \
  }

// scores[r][j] → probabilities: exp(score - lse_r) inside row r's mask, 0 outside it. Without
// `lse` (the forward pass), the row's own log-sum-exp is computed and stored there.
void probabilities(const Block& blk, const int32_t* seg, float* scores, int64_t sld, float* lse,
                   bool have_lse) {
  const f32v hidden = f32v{} - INFINITY;
  i32v lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  for (int r = 0; r < blk.rows; ++r) {
    float* p = scores + r * sld;
    const int64_t last = blk.pos[r] - blk.lo;  // keys after the query are hidden
    const int32_t id = seg[blk.pos[r]];
    const int32_t* ids = seg + blk.lo;
    f32v top_v = hidden;
    int64_t j = 0;
    for (; j + kLanes <= blk.n; j += kLanes) {
      i32v other;
      std::memcpy(&other, ids + j, sizeof other);
      const i32v seen = (lane + int32_t(j) <= int32_t(last)) & (other == id);
      const f32v x = seen ? load(p + j) : hidden;
      store(p + j, x);
      top_v = x > top_v ? x : top_v;
    }
    float top = -INFINITY;
    for (int i = 0; i < kLanes; ++i) top = std::max(top, top_v[i]);
    for (; j < blk.n; ++j) {
      if (j > last || ids[j] != id) p[j] = -INFINITY;
      top = std::max(top, p[j]);
    }
    if (have_lse) top = lse[r];
    const float total = exp_shifted(p, blk.n, top);
    if (!have_lse) {
      const float inv = 1.0f / total;
      for (j = 0; j + kLanes <= blk.n; j += kLanes) store(p + j, load(p + j) * inv);
      for (; j < blk.n; ++j) p[j] *= inv;
      lse[r] = top + std::log(total);
    }
  }
}

struct Inputs {
  const float *q, *k, *v;
  const float *k_cols, *v_cols;  // k and v as [b, kv_heads, e, t]: keys are columns
  const int32_t* seg;
};

struct ForwardWork : Tasks {
  Shapes s;
  Inputs in;
  float *out, *lse;
  std::vector<int32_t> first;  // [b, t]
  int64_t tiles = 0;

  void run(int64_t task, int64_t) {
    const int64_t row = task / (s.kv_heads * tiles), kv = task / tiles % s.kv_heads;
    const int64_t p0 = task % tiles * kPositions, p1 = std::min(s.t, p0 + kPositions);
    const int64_t hs = s.heads * s.e, ks = s.kv_heads * s.e;  // strides of one position
    const float* q = in.q + row * s.t * hs;
    const float* v = in.v + row * s.t * ks + kv * s.e;
    const int32_t* seg = in.seg + row * s.t;
    const int32_t* fst = first.data() + row * s.t;
    const float* cols = in.k_cols + (row * s.kv_heads + kv) * s.e * s.t;
    thread_local std::vector<float> scores;
    scores.resize(kRows * s.t);
    for_blocks(s, kv, p0, p1, fst, [&](const Block& blk) {
      const float* x[kRows];
      float* o[kRows];
      float lse_r[kRows];
      for (int r = 0; r < blk.rows; ++r) {
        x[r] = q + blk.pos[r] * hs + blk.head[r] * s.e;
        o[r] = out + (row * s.t + blk.pos[r]) * hs + blk.head[r] * s.e;
      }
      const int rows = blk.rows;
      float* sc = scores.data();
      DISPATCH_ROWS(row_dots, x, cols + blk.lo, s.t, blk.n, s.e, s.scale, sc, s.t)
      probabilities(blk, seg, sc, s.t, lse_r, false);
      for (int64_t c0 = 0; c0 < s.e; c0 += kChunk * kLanes)
        DISPATCH_ROWS(weighted_rows, sc, s.t, v + blk.lo * ks, ks, blk.n, c0, o, 1.0f)
      for (int r = 0; r < blk.rows; ++r)
        lse[(row * s.t + blk.pos[r]) * s.heads + blk.head[r]] = lse_r[r];
    });
  }
};

struct BackwardWork : Tasks {
  Shapes s;
  Inputs in;
  const float *out, *lse, *d_out;
  float *d_q, *d_k, *d_v;
  std::vector<int32_t> first;

  // One task per (batch row, kv head): it owns that head's d_k and d_v rows.
  void run(int64_t task, int64_t) {
    const int64_t row = task / s.kv_heads, kv = task % s.kv_heads;
    const int64_t hs = s.heads * s.e, ks = s.kv_heads * s.e, t = s.t;
    const int64_t base_q = row * t * hs, base_k = row * t * ks + kv * s.e;
    const float *q = in.q + base_q, *o = out + base_q, *dout = d_out + base_q;
    const float *k = in.k + base_k, *v = in.v + base_k;
    float *dk = d_k + base_k, *dv = d_v + base_k, *dq = d_q + base_q;
    const int32_t* seg = in.seg + row * t;
    const int32_t* fst = first.data() + row * t;
    for (int64_t j = 0; j < t; ++j) {
      std::memset(dk + j * ks, 0, sizeof(float) * s.e);
      std::memset(dv + j * ks, 0, sizeof(float) * s.e);
    }
    const int64_t at_cols = (row * s.kv_heads + kv) * s.e * t;
    const float *k_cols = in.k_cols + at_cols, *v_cols = in.v_cols + at_cols;
    thread_local std::vector<float> probs, d_scores;
    probs.resize(kRows * t);
    d_scores.resize(kRows * t);
    for_blocks(s, kv, 0, t, fst, [&](const Block& blk) {
      const float *xq[kRows], *xd[kRows];
      float* gq[kRows];
      float lse_r[kRows], dot_r[kRows];
      for (int r = 0; r < blk.rows; ++r) {
        const int64_t at = blk.pos[r] * hs + blk.head[r] * s.e;
        xq[r] = q + at;
        xd[r] = dout + at;
        gq[r] = dq + at;
        lse_r[r] = lse[(row * t + blk.pos[r]) * s.heads + blk.head[r]];
        float d = 0.0f;  // rowsum(dP * P) = dO . O, as flash attention takes it
        for (int64_t c = 0; c < s.e; ++c) d += xd[r][c] * o[at + c];
        dot_r[r] = d;
      }
      const int rows = blk.rows;
      float *p = probs.data(), *ds = d_scores.data();
      DISPATCH_ROWS(row_dots, xq, k_cols + blk.lo, t, blk.n, s.e, s.scale, p, t)
      DISPATCH_ROWS(row_dots, xd, v_cols + blk.lo, t, blk.n, s.e, 1.0f, ds, t)
      probabilities(blk, seg, p, t, lse_r, true);
      for (int r = 0; r < blk.rows; ++r)  // dS = P * (dP - rowsum), times the score scale
        for (int64_t j = 0; j < blk.n; ++j)
          ds[r * t + j] = p[r * t + j] * (ds[r * t + j] - dot_r[r]) * s.scale;
      for (int64_t c0 = 0; c0 < s.e; c0 += kChunk * kLanes) {
        DISPATCH_ROWS(weighted_rows, ds, t, k + blk.lo * ks, ks, blk.n, c0, gq, 1.0f)
        DISPATCH_ROWS(scatter_rows, p, t, xd, c0, dv + blk.lo * ks, ks, blk.n)
        DISPATCH_ROWS(scatter_rows, ds, t, xq, c0, dk + blk.lo * ks, ks, blk.n)
      }
    });
  }
};

ffi::Error check_shapes(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k,
                        ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::S32>& seg, Shapes* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = seg.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || sd.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument(
        "harnessrl attention takes q [b, t, heads, e], k and v [b, t, kv_heads, e], segment_ids "
        "[b, t]");
  if (kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || sd[0] != qd[0] || sd[1] != qd[1] ||
      kd[2] < 1 || qd[2] % kd[2] != 0 || qd[3] % (kChunk * kLanes) != 0)
    return ffi::Error::InvalidArgument(
        "harnessrl attention: shapes disagree (or head_dim is not a multiple of 64)");
  *s = Shapes{qd[0], qd[1], qd[2], kd[2], qd[3], qd[2] / kd[2], 1.0f / std::sqrt(float(qd[3]))};
  return ffi::Error::Success();
}

template <typename W>
void first_positions(const Shapes& s, const int32_t* seg, W& work) {
  work.first.resize(s.b * s.t);
  for (int64_t row = 0; row < s.b; ++row)
    segment_first(seg + row * s.t, s.t, work.first.data() + row * s.t);
}

ffi::Error AttentionForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::F32> k_cols, ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse) {
  auto work = std::make_shared<ForwardWork>();
  if (auto err = check_shapes(q, k, v, seg, &work->s); err.failure()) return err;
  const Shapes& s = work->s;
  if (k_cols.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("harnessrl attention: k_cols must be k as [b, kv, e, t]");
  work->in = Inputs{q.typed_data(), k.typed_data(), v.typed_data(), k_cols.typed_data(), nullptr,
                    seg.typed_data()};
  work->out = out->typed_data();
  work->lse = lse->typed_data();
  first_positions(s, seg.typed_data(), *work);
  work->tiles = (s.t + kPositions - 1) / kPositions;
  work->tasks = s.b * s.kv_heads * work->tiles;
  run_tasks(pool, work);
  return ffi::Error::Success();
}

ffi::Error AttentionBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                             ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                             ffi::Buffer<ffi::F32> k_cols, ffi::Buffer<ffi::F32> v_cols,
                             ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> out,
                             ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> d_out,
                             ffi::ResultBuffer<ffi::F32> d_q, ffi::ResultBuffer<ffi::F32> d_k,
                             ffi::ResultBuffer<ffi::F32> d_v) {
  auto work = std::make_shared<BackwardWork>();
  if (auto err = check_shapes(q, k, v, seg, &work->s); err.failure()) return err;
  const Shapes& s = work->s;
  if (k_cols.element_count() != k.element_count() || v_cols.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("harnessrl attention: k_cols, v_cols must be [b, kv, e, t]");
  work->in = Inputs{q.typed_data(),      k.typed_data(),      v.typed_data(),
                    k_cols.typed_data(), v_cols.typed_data(), seg.typed_data()};
  work->out = out.typed_data();
  work->lse = lse.typed_data();
  work->d_out = d_out.typed_data();
  work->d_q = d_q->typed_data();
  work->d_k = d_k->typed_data();
  work->d_v = d_v->typed_data();
  first_positions(s, seg.typed_data(), *work);
  work->tasks = s.b * s.kv_heads;
  run_tasks(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessrlAttentionForward, AttentionForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessrlAttentionBackward, AttentionBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
