// Engine stage, CPU kernel: a few activation rows times one layer's weight matrix, for decoding.
//
// In: x [rows, k] float32, the stacked weights w [layers, k, n] (or [layers, n, k] when
// `transposed`) as float32 or as bfloat16 words (uint16), and the layer index. Out: [rows, n]
// float32. Registered as the XLA FFI target `harnessrl_matvec` (see matvec.py).
//
// Why: a decode step multiplies 8 rows by every weight matrix once, so it is bound by the bytes of
// weights it streams. XLA:CPU's dot packs the whole weight panel before multiplying, at about half
// the bandwidth of a plain read, and runs bfloat16 dots several times slower still. This kernel
// reads each weight once, straight from the stacked array (no per-layer slice copy), widens
// bfloat16 words to float32 in registers and accumulates in float32 with FMAs: the float32
// arithmetic of the rounded weights, as the XLA path computes it, up to summation order.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;      // float32 lanes of one vector
constexpr int kMaxRows = 8;     // rows kept in registers at once
constexpr int kMinSlab = 64;    // fewest weight rows worth a task of their own
constexpr int kRowChunk = 256;  // weight rows one task of the transposed kernel reads

typedef float f32v __attribute__((vector_size(kLanes * 4)));
typedef uint16_t u16v __attribute__((vector_size(kLanes * 2)));
typedef uint32_t u32v __attribute__((vector_size(kLanes * 4)));

inline __attribute__((always_inline)) f32v load(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

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

inline __attribute__((always_inline)) float sum(f32v v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// acc[:, :] += x[:, d0:d1] @ w[d0:d1, :] for w [k, n], R rows, acc [R, n]: the weight rows of
// the slab are read front to back, two at a time, so the stream is sequential and each weight byte
// is loaded once; the activations of those two rows wait in registers, the sums in L1/L2.
template <int R, typename W>
inline __attribute__((always_inline)) void kn_rows(const float* x, const W* w, float* acc,
                                                  int64_t k, int64_t n, int64_t d0, int64_t d1) {
  const int64_t vec_end = n / kLanes * kLanes;
  const f32v zero = {};
  int64_t d = d0;
  for (; d + 2 <= d1; d += 2) {
    f32v x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = zero + x[r * k + d];
      x1[r] = zero + x[r * k + d + 1];
    }
    const W* w0 = w + d * n;
    const W* w1 = w0 + n;
    for (int64_t c = 0; c < vec_end; c += kLanes) {
      const f32v a = load(w0 + c), b = load(w1 + c);
      for (int r = 0; r < R; ++r) {
        f32v s = load(acc + r * n + c);
        s += x0[r] * a;
        s += x1[r] * b;
        std::memcpy(acc + r * n + c, &s, sizeof s);
      }
    }
    for (int64_t c = vec_end; c < n; ++c)
      for (int r = 0; r < R; ++r)
        acc[r * n + c] += x[r * k + d] * scalar(w0[c]) + x[r * k + d + 1] * scalar(w1[c]);
  }
  for (; d < d1; ++d)  // an odd last row
    for (int64_t c = 0; c < n; ++c)
      for (int r = 0; r < R; ++r) acc[r * n + c] += x[r * k + d] * scalar(w[d * n + c]);
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

// Tasks are claimed from a shared counter by the calling thread and by helpers scheduled on XLA's
// intra-op pool. The caller waits only for tasks already claimed (they run on live threads), so
// the call finishes even when no helper ever starts; a helper that starts late finds no task and
// touches nothing but the state it co-owns.
//
// Transposed (w [n, k]): task t computes output columns [t*span, (t+1)*span) into `out`.
// Otherwise (w [k, n]): task t sums weight rows [t*span, (t+1)*span) into its own partial [rows, n],
// and the caller adds the partials: every task then streams one contiguous slab of weights.
struct Work {
  Job job;
  int64_t tasks = 0, span = 0;
  std::vector<float> partial;  // [tasks, rows, n], zeroed; the k-split only
  std::atomic<int64_t> next{0}, done{0};

  void run(int64_t t) {
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
        float* acc = partial.data() + (t * job.rows + r0) * job.n;
        if (job.bits)
          kn_chunk(x, static_cast<const uint16_t*>(job.w), acc, rows, job.k, job.n, i0, i1);
        else
          kn_chunk(x, static_cast<const float*>(job.w), acc, rows, job.k, job.n, i0, i1);
      }
    }
  }

  void drain() {
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      run(t);
      done.fetch_add(1, std::memory_order_release);
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
  } else {  // one slab per thread, of an even number of rows
    work->tasks = std::max<int64_t>(1, std::min<int64_t>(threads, k / kMinSlab));
    work->span = ((k + work->tasks - 1) / work->tasks + 1) / 2 * 2;
    work->partial.assign(work->tasks * rows * n, 0.0f);
  }
  const int64_t helpers = std::min(threads, work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->tasks) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  if (!transposed) {
    float* y = out->typed_data();
    const float* p = work->partial.data();
    std::memcpy(y, p, sizeof(float) * rows * n);
    for (int64_t t = 1; t < work->tasks; ++t)
      for (int64_t i = 0; i < rows * n; ++i) y[i] += p[t * rows * n + i];
  }
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
