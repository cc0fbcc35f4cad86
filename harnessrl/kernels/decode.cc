// Serving-side CPU kernels of a decode step (see harnessrl/engine/cpu_kernels.py), as XLA FFI targets:
//
// `harnessrl_matvec`: x [rows, k] float32 times layer l of the stacked weights w [layers, k, n]
// (or [layers, n, k] when `transposed`), float32 or bfloat16 words (uint16) → [rows, n] float32.
// `harnessrl_decode_attention`: one query per cache slot over that slot's cache positions, read
// in place from the [layers, slots, len, kv_heads, head_dim] cache (below).
//
// Why: a decode step multiplies 8 rows by every weight matrix once, so it is bound by the bytes of
// weights it streams. XLA:CPU's dot packs the whole weight panel before multiplying, at about half
// the bandwidth of a plain read, and runs bfloat16 dots several times slower still. This kernel
// reads each weight once, straight from the stacked array (no per-layer slice copy), widens
// bfloat16 words to float32 in registers and accumulates in float32 with FMAs: the float32
// arithmetic of the rounded weights, as the XLA path computes it, up to summation order.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "task_runner.h"
#include "vectors.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;     // rows kept in registers at once
constexpr int kMinSlab = 32;    // fewest weight rows worth a task of their own
constexpr int kSlabsPerThread = 4;  // slabs per thread: a helper that wakes late still takes some
constexpr int kRowChunk = 256;  // weight rows one task of the transposed kernel reads

typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));

using ::load;  // vectors.h's float32 overload beside this bfloat16 one

inline __attribute__((always_inline)) f32v load(const uint16_t* p) {
#if defined(__AVX512F__)
  // One zero-extending move and one shift; the generic form below compiles to five operations.
  __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  return (f32v)_mm512_castsi512_ps(wide);
#else
  u16v h;
  std::memcpy(&h, p, sizeof h);
  u32v wide = __builtin_convertvector(h, u32v) << 16;  // bfloat16 is float32's top half
  f32v v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
#endif
}

inline __attribute__((always_inline)) float scalar(float w) { return w; }
inline __attribute__((always_inline)) float scalar(uint16_t w) {
  uint32_t bits = uint32_t(w) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The lanes' total by halving (8 + 8, 4 + 4, ...): four dependent adds where a lane-by-lane sum
// chains sixteen. The head's and the attention's dot products end in one of these each, so the
// chain's latency, not the products, was what a sequential sum spent their time on.
inline __attribute__((always_inline)) float sum(f32v v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof v);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
#endif
}

// acc[:, c0:c0+C*kLanes] += x[:, d0:d1] @ w[d0:d1, c0:c0+C*kLanes] for w [k, n], R rows: the sums
// of the R rows x C vectors of columns stay in registers while the slab's weight rows go by, one
// row segment (a cache line of bfloat16 weights at C = 2) and R broadcast activations per step.
template <int R, int C, typename W>
inline __attribute__((always_inline)) void kn_block(const float* x, const W* w, float* acc,
                                                   int64_t k, int64_t n, int64_t c0, int64_t d0,
                                                   int64_t d1) {
  f32v sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) sums[r][j] = load(acc + r * n + c0 + j * kLanes);
  for (int64_t d = d0; d < d1; ++d) {
    const W* row = w + d * n + c0;
    f32v wv[C];
    for (int j = 0; j < C; ++j) wv[j] = load(row + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k + d];
      for (int j = 0; j < C; ++j) sums[r][j] += xr * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) std::memcpy(acc + r * n + c0 + j * kLanes, &sums[r][j], sizeof(f32v));
}

// acc[:, :] += x[:, d0:d1] @ w[d0:d1, :] for w [k, n], R rows. Column blocks of two vectors, each
// summed over the slab's weight rows in registers (a running sum per row in memory would cost a
// load and a store per product, from L2 once R x n floats outgrow L1), then one vector, then
// single columns. Each sum adds its products in weight-row order, as the float32 XLA dot would.
template <int R, typename W>
inline __attribute__((always_inline)) void kn_rows(const float* x, const W* w, float* acc,
                                                  int64_t k, int64_t n, int64_t d0, int64_t d1) {
  int64_t c = 0;
  for (; c + 2 * kLanes <= n; c += 2 * kLanes) kn_block<R, 2>(x, w, acc, k, n, c, d0, d1);
  for (; c + kLanes <= n; c += kLanes) kn_block<R, 1>(x, w, acc, k, n, c, d0, d1);
  for (; c < n; ++c)
    for (int r = 0; r < R; ++r)
      for (int64_t d = d0; d < d1; ++d) acc[r * n + c] += x[r * k + d] * scalar(w[d * n + c]);
}

// out[:, j0:j1] = x @ w[j0:j1, :]^T for w [n, k], R rows: each weight row is a dot product with
// every activation row; two weight rows at a time halve the activation loads.
template <int R, typename W>
inline __attribute__((always_inline)) void nk_rows(const float* x, const W* w, float* out,
                                                  int64_t k, int64_t n, int64_t j0, int64_t j1) {
  const int64_t vec_end = k / kLanes * kLanes;
  int64_t j = j0;
  for (; j + 2 <= j1; j += 2) {
    f32v a0[R] = {}, a1[R] = {};
    const W* wa = w + j * k;
    const W* wb = wa + k;
    for (int64_t d = 0; d < vec_end; d += kLanes) {
      const f32v va = load(wa + d), vb = load(wb + d);
      for (int r = 0; r < R; ++r) {
        const f32v xv = load(x + r * k + d);
        a0[r] += xv * va;
        a1[r] += xv * vb;
      }
    }
    for (int r = 0; r < R; ++r) {
      float s0 = sum(a0[r]), s1 = sum(a1[r]);
      for (int64_t d = vec_end; d < k; ++d) {
        s0 += x[r * k + d] * scalar(wa[d]);
        s1 += x[r * k + d] * scalar(wb[d]);
      }
      out[r * n + j] = s0;
      out[r * n + j + 1] = s1;
    }
  }
  for (; j < j1; ++j)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t d = 0; d < k; ++d) s += x[r * k + d] * scalar(w[j * k + d]);
      out[r * n + j] = s;
    }
}

// The row count becomes a compile-time constant, so the running sums stay in registers.
#define DISPATCH_ROWS(KERNEL, ...)                       \
  switch (rows) {                                        \
    case 1: return KERNEL<1>(__VA_ARGS__);               \
    case 2: return KERNEL<2>(__VA_ARGS__);               \
    case 3: return KERNEL<3>(__VA_ARGS__);               \
    case 4: return KERNEL<4>(__VA_ARGS__);               \
    case 5: return KERNEL<5>(__VA_ARGS__);               \
    case 6: return KERNEL<6>(__VA_ARGS__);               \
    case 7: return KERNEL<7>(__VA_ARGS__);               \
    default: return KERNEL<8>(__VA_ARGS__);              \
  }

template <typename W>
inline __attribute__((always_inline)) void kn_chunk(const float* x, const W* w, float* acc,
                                                   int64_t rows, int64_t k, int64_t n, int64_t d0,
                                                   int64_t d1) {
  DISPATCH_ROWS(kn_rows, x, w, acc, k, n, d0, d1)
}

template <typename W>
inline __attribute__((always_inline)) void nk_chunk(const float* x, const W* w, float* out,
                                                   int64_t rows, int64_t k, int64_t n, int64_t j0,
                                                   int64_t j1) {
  DISPATCH_ROWS(nk_rows, x, w, out, k, n, j0, j1)
}

struct Job {
  const float* x;
  const void* w;
  float* out;
  int64_t rows, k, n;
  bool transposed, bits;
};

// Transposed (w [n, k]): task t computes output columns [t*span, (t+1)*span) into `out`.
// Otherwise (w [k, n]): task t sums weight rows [t*span, (t+1)*span) into its thread's partial
// [rows, n], and the caller adds the partials: every task streams one contiguous slab of weights.
struct Work : Tasks {
  Job job;
  int64_t span = 0;
  std::vector<float> partial;  // [threads, rows, n], zeroed; the k-split only

  void run(int64_t t, int64_t slot) {
    const int64_t end = job.transposed ? job.n : job.k;
    const int64_t i0 = t * span, i1 = i0 + span < end ? i0 + span : end;
    for (int64_t r0 = 0; r0 < job.rows; r0 += kMaxRows) {
      const int64_t rows = job.rows - r0 < kMaxRows ? job.rows - r0 : kMaxRows;
      const float* x = job.x + r0 * job.k;
      if (job.transposed) {
        float* out = job.out + r0 * job.n;
        if (job.bits)
          nk_chunk(x, static_cast<const uint16_t*>(job.w), out, rows, job.k, job.n, i0, i1);
        else
          nk_chunk(x, static_cast<const float*>(job.w), out, rows, job.k, job.n, i0, i1);
      } else {
        float* acc = partial.data() + (slot * job.rows + r0) * job.n;
        if (job.bits)
          kn_chunk(x, static_cast<const uint16_t*>(job.w), acc, rows, job.k, job.n, i0, i1);
        else
          kn_chunk(x, static_cast<const float*>(job.w), acc, rows, job.k, job.n, i0, i1);
      }
    }
  }
};

ffi::Error MatVec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, bool transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("harnessrl_matvec takes x [rows, k] and w [layers, ., .]");
  const int64_t rows = xd[0], k = xd[1];
  const int64_t n = transposed ? wd[1] : wd[2];
  if ((transposed ? wd[2] : wd[1]) != k)
    return ffi::Error::InvalidArgument("harnessrl_matvec: x and w disagree on k");
  const bool bits = w.element_type() == ffi::U16;
  if (!bits && w.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("harnessrl_matvec: w must be float32 or uint16 words");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("harnessrl_matvec: bad layer index");
  const size_t esize = bits ? 2 : 4;
  const char* base = static_cast<const char*>(w.untyped_data()) + l * k * n * esize;

  auto work = std::make_shared<Work>();
  work->job = Job{x.typed_data(), base, out->typed_data(), rows, k, n, transposed, bits};
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (transposed) {
    work->span = kRowChunk;
    work->tasks = (n + kRowChunk - 1) / kRowChunk;
  } else {  // slabs of weight rows, a few per thread
    const int64_t slab = (k + threads * kSlabsPerThread - 1) / (threads * kSlabsPerThread);
    work->span = std::max<int64_t>(kMinSlab, slab);
    work->tasks = (k + work->span - 1) / work->span;
    work->partial.assign(std::min(threads, work->tasks) * rows * n, 0.0f);
  }
  run_tasks(pool, work);
  if (!transposed) {  // every partial that a thread joined is complete: its tasks are all done
    float* y = out->typed_data();
    const float* p = work->partial.data();
    std::memcpy(y, p, sizeof(float) * rows * n);
    for (int64_t t = 1; t < work->joined.load(std::memory_order_acquire); ++t)
      for (int64_t i = 0; i < rows * n; ++i) y[i] += p[t * rows * n + i];
  }
  return ffi::Error::Success();
}

// ---- decode attention ----------------------------------------------------------------------
// out[s, h] = softmax_m(q[s, h] . k[layer, s, m, h / g] / sqrt(e)) @ v[layer, s, m, h / g] over the
// cache positions m = 0..positions[s] of slot s (g = heads / kv_heads): straight from the cache, so
// no window of it is copied, and each slot reads only its own length. A slot at position -1
// (idle) gets zeros.
struct AttentionJob {
  const float *q, *k, *v;
  float* out;
  const int32_t* positions;
  int64_t slots, max_len, heads, kv_heads, e;
};

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t e) {
  f32v acc = {};
  int64_t i = 0;
  for (; i + kLanes <= e; i += kLanes) acc += load(a + i) * load(b + i);
  float s = sum(acc);
  for (; i < e; ++i) s += a[i] * b[i];
  return s;
}

void attend_slot(const AttentionJob& job, int64_t s) {
  thread_local std::vector<float> scores;
  const int64_t e = job.e, g = job.heads / job.kv_heads, row = job.kv_heads * e;
  float* out = job.out + s * job.heads * e;
  std::memset(out, 0, sizeof(float) * job.heads * e);
  const int64_t n = int64_t(job.positions[s]) + 1;  // positions 0..p
  if (n <= 0) return;
  const float* q = job.q + s * job.heads * e;
  const float* k = job.k + s * job.max_len * row;
  const float* v = job.v + s * job.max_len * row;
  const float scale = 1.0f / std::sqrt(float(e));
  scores.resize(job.heads * n);
  for (int64_t h = 0; h < job.heads; ++h) {
    float* p = scores.data() + h * n;
    const float* kh = k + (h / g) * e;
    float top = -INFINITY;
    for (int64_t m = 0; m < n; ++m) {
      p[m] = dot(q + h * e, kh + m * row, e) * scale;
      top = p[m] > top ? p[m] : top;
    }
    float total = 0.0f;
    for (int64_t m = 0; m < n; ++m) total += (p[m] = std::exp(p[m] - top));
    const float inv = 1.0f / total;
    for (int64_t m = 0; m < n; ++m) p[m] *= inv;
  }
  for (int64_t m = 0; m < n; ++m)  // the values, position by position: one pass over the cache
    for (int64_t h = 0; h < job.heads; ++h) {
      const float w = scores[h * n + m];
      const float* vh = v + m * row + (h / g) * e;
      float* o = out + h * e;
      int64_t i = 0;
      for (; i + kLanes <= e; i += kLanes) {
        f32v acc = load(o + i) + w * load(vh + i);
        std::memcpy(o + i, &acc, sizeof acc);
      }
      for (; i < e; ++i) o[i] += w * vh[i];
    }
}

struct AttentionWork : Tasks {
  AttentionJob job;
  void run(int64_t s, int64_t) { attend_slot(job, s); }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument(
        "harnessrl_decode_attention takes q [slots, heads, e] and k, v [layers, slots, len, kv, e]");
  const int64_t slots = qd[0], heads = qd[1], e = qd[2];
  if (kd[1] != slots || kd[4] != e || kd[3] < 1 || heads % kd[3] != 0 ||
      positions.element_count() != size_t(slots))
    return ffi::Error::InvalidArgument("harnessrl_decode_attention: shapes disagree");
  const int64_t l = layer.typed_data()[0], max_len = kd[2];
  if (l < 0 || l >= kd[0])
    return ffi::Error::InvalidArgument("harnessrl_decode_attention: bad layer index");
  for (int64_t s = 0; s < slots; ++s)
    if (positions.typed_data()[s] >= max_len)
      return ffi::Error::InvalidArgument("harnessrl_decode_attention: position past the cache");
  const int64_t layer_size = slots * max_len * kd[3] * e;
  auto work = std::make_shared<AttentionWork>();
  work->job = AttentionJob{q.typed_data(), k.typed_data() + l * layer_size,
                           v.typed_data() + l * layer_size, out->typed_data(),
                           positions.typed_data(), slots, max_len, heads, kd[3], e};
  work->tasks = slots;
  run_tasks(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessrlMatVec, MatVec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarnessrlDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
