// The vector type of the CPU kernels: 16 float32 lanes (one AVX-512 register; two or four
// narrower ones where the compiler targets less), with unaligned loads and stores.
#pragma once

#include <cstdint>
#include <cstring>

constexpr int kLanes = 16;  // float32 lanes of one vector

typedef float f32v __attribute__((vector_size(kLanes * 4)));

inline __attribute__((always_inline)) f32v load(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store(float* p, f32v v) { std::memcpy(p, &v, sizeof v); }
